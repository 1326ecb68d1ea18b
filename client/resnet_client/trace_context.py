"""W3C trace context on the client's calls: the caller's own OpenTelemetry context where ``opentelemetry-api`` is
installed (it is optional: the client stays light without it), or, when asked, a new sampled trace of the call's
own; and the trace id the server's answer names (its ``traceparent`` trailing metadata, when it traces)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

try:
    from opentelemetry import propagate as _propagate
except ImportError:  # not installed: calls carry a context only when asked for a new trace
    _propagate = None  # type: ignore[assignment]  # the module, or None where it is not installed


def outgoing(new_trace: bool) -> list[tuple[str, str]]:
    """The trace context a call carries: the caller's current one, else with ``new_trace`` a new, sampled one."""
    carrier: dict[str, str] = {}
    if _propagate is not None:
        _propagate.inject(carrier)
    if new_trace and "traceparent" not in carrier:
        carrier["traceparent"] = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    return list(carrier.items())


def trace_id(trailing: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The trace id of the server's span for a call, "" when it did not trace it."""
    for key, value in trailing or ():
        if key == "traceparent" and isinstance(value, str) and value.count("-") == 3:
            return value.split("-")[1]
    return ""
