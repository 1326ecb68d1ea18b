"""Log output: readable lines for a terminal, or one JSON object per line for a log pipeline."""

from __future__ import annotations

import datetime
import json
import logging
from contextvars import ContextVar

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")

# The request id of the call being served, set where a front-end's methods are registered: its log lines say it.
current_request: ContextVar[str] = ContextVar("current_request", default="")
# Which protocol carries it (grpc, http): gRPC's calls run in tasks of their own, as aiohttp's requests do, and the
# HTTP front-end sets it for each of its own. Its metrics' and span's ``protocol``.
current_protocol: ContextVar[str] = ContextVar("current_protocol", default="grpc")


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message"} and, when there are, "request_id", the trace's ids and
    "exception" (the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := current_request.get():
            entry["request_id"] = rid
        if ids := _trace_ids(record):
            entry["trace_id"], entry["span_id"] = ids
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, and after the message a call's ``request_id=...`` and ``trace_id=... span_id=...`` when it
    has them."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record)
        if rid := current_request.get():
            line = f"{line} request_id={rid}"
        return f"{line} trace_id={ids[0]} span_id={ids[1]}" if (ids := _trace_ids(record)) else line


class TraceIds(logging.Filter):
    """Gives each record written while a call's span is current (resnet_server.frontend.tracing) its trace and span
    ids."""

    def filter(self, record: logging.LogRecord) -> bool:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_ids = (f"{context.trace_id:032x}", f"{context.span_id:016x}")
        return True


def _trace_ids(record: logging.LogRecord) -> tuple[str, str] | None:
    ids = getattr(record, "trace_ids", None)
    return ids if isinstance(ids, tuple) else None


def log_trace_ids() -> None:
    """From now on (tracing is on), log lines about a call carry its trace and span ids."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIds())


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # Python warnings (torch's, torchvision's) go through logging too, so a JSON log stays JSON.
    logging.captureWarnings(True)
