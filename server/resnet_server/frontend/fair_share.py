"""Who a call's caller is, for the engines' fair share of a device (resnet_server.engine.fair_queue) and of its
queue (resnet_server.boundary.queue_share): its bearer token's entry in the token file (``--fair-share token``),
or its address without the port (``peer``: more connections buy no more share), or one caller for all (``off``:
first come, first served)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from resnet_server.common.flag_files import TokenEntry
from resnet_server.frontend.security import presented_token


class CallerId(NamedTuple):
    """A caller as the queue sees it: ``key`` tells callers apart, ``label`` is its class in metrics (a token's
    name, or ``peer``: an address is never a label), ``weight`` its share beside the others."""

    key: str
    label: str
    weight: int = 1


EVERYONE = CallerId("", "all")  # --fair-share off: one caller


def resolved_mode(mode: str, tokens_on: bool) -> str:
    """``auto``: by token where tokens are on, else by peer."""
    if mode != "auto":
        return mode
    return "token" if tokens_on else "peer"


def callers_by(mode: str, tokens: Sequence[TokenEntry]) -> Callable[[Any], CallerId]:
    """What tells one caller from another in a call's context (gRPC's, or the HTTP front-end's)."""
    if mode == "token":
        known = {_digest(entry.token): CallerId(entry.name, entry.name, entry.weight) for entry in tokens}
        unknown = CallerId("?", "unknown")  # no valid token: only open calls (health), which queue nothing
        return lambda context: known.get(_digest(presented_token(context.invocation_metadata())), unknown)
    if mode == "peer":
        return lambda context: CallerId(peer_host(context.peer()), "peer")
    return lambda context: EVERYONE


def _digest(token: bytes) -> bytes:
    """Tokens are looked up by a digest: a dict's comparison of the token itself would not be constant-time."""
    return hashlib.blake2b(token, digest_size=16).digest()


def peer_host(peer: str) -> str:
    """The address in gRPC's peer string (``ipv4:10.0.0.5:43122``, ``ipv6:[::1]:43122``), without its port."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0]
    if kind == "ipv6":
        return address.rpartition(":")[0].strip("[]")
    return peer  # unix sockets and the like: the whole of it
