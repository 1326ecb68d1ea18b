"""Each call's request id: the caller's (a ModelInferRequest's ``id`` or its x-request-id), else a fresh one; set
as the current one (resnet_server.common.logs) where each method is registered (resnet_server.frontend.handlers),
and read by the log lines, the INTERNAL messages and the engine."""

from __future__ import annotations

import itertools
import os
import re

import grpc

from resnet_server.common.logs import current_request

MOST_ID_CHARACTERS = 64
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
# Fresh request ids: this process's random prefix and a count, unique across processes and restarts as a uuid4
# is, and cheaper: every call without an x-request-id pays for one.
_ID_PREFIX = os.urandom(4).hex()
_ID_COUNT = itertools.count()

def request_id(context: grpc.aio.ServicerContext, given: str = "") -> str:
    """The id the caller gave (``given``: a ModelInferRequest's ``id``), else its x-request-id, else a fresh one.
    A caller's id is cut to MOST_ID_CHARACTERS and anything but printable ASCII becomes ``?``, so that no id costs
    more than that once per image, nor forges a line in a text log."""
    if not given:
        given = next((str(value) for key, value in context.invocation_metadata() or () if key == "x-request-id"), "")
    if given:
        return _UNPRINTABLE.sub("?", given[:MOST_ID_CHARACTERS])
    return f"{_ID_PREFIX}{next(_ID_COUNT):08x}"


def call_id(context: grpc.aio.ServicerContext, given: str = "") -> str:
    """The call's request id, set as the current one (``given`` as for request_id)."""
    rid = request_id(context, given)
    current_request.set(rid)
    return rid
