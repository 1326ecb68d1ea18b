"""Who a call's caller is, for the engines' fair share of a device (resnet_server.engine.fair_queue): the digest of
its bearer token (``--fair-share token``), or its address without the port (``peer``: more connections buy no
more share), or one caller for all (``off``: first come, first served)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from resnet_server.frontend.security import presented_token


def resolved_mode(mode: str, tokens_on: bool) -> str:
    """``auto``: by token where tokens are on, else by peer."""
    if mode != "auto":
        return mode
    return "token" if tokens_on else "peer"


def caller_keys(mode: str) -> Callable[[Any], str]:
    """What tells one caller from another in a call's context (gRPC's, or the HTTP front-end's)."""
    if mode == "token":
        return lambda context: hashlib.blake2b(presented_token(context.invocation_metadata()),
                                               digest_size=8).hexdigest()
    if mode == "peer":
        return lambda context: peer_host(context.peer())
    return lambda context: ""


def peer_host(peer: str) -> str:
    """The address in gRPC's peer string (``ipv4:10.0.0.5:43122``, ``ipv6:[::1]:43122``), without its port."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0]
    if kind == "ipv6":
        return address.rpartition(":")[0].strip("[]")
    return peer  # unix sockets and the like: the whole of it
