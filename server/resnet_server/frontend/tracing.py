"""OpenTelemetry traces of the calls a front-end serves: one server span per call (per message on a stream),
with the request's path inside as child spans at their real times.

The engine has no tracing code: it already sends back, with each image's answer, how long the image waited in
its queue and how long its batch's compute took (in parts), and which batch it was. The front-end builds the
spans from those when the call ends: the queue and compute spans end when the answer came back and last exactly
what the engine measured; the decode span covers the front-end's validation and decoding, the answer span the
writing of the response.

Off unless ``--otlp-endpoint`` (or the SDK's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``)
names a receiver; then spans go through the SDK's batch processor (no call waits on the exporter; an exporter
that cannot reach its receiver drops spans and the SDK logs it). Off, nothing here is imported and no call does
any tracing work. A caller's W3C ``traceparent``/``tracestate`` (call metadata; on a stream, the stream's,
for each of its messages) is the parent, its sampled flag honoured both ways; a call without one is sampled at
``--trace-rate``.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import grpc

from resnet_server.common.errors import InvalidInput, outcome
from resnet_server.common.logs import current_protocol
from resnet_server.common.work import ImageOutput

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext, Tracer

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_SERVICE_NAME = "resnet-server"
EXPORT_WARNING_SECONDS = 60.0
# Where the SDK's exporters log a failed export (a logger's filter sees only its own records, not its children's).
EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                  "opentelemetry.exporter.otlp.proto.http._common",
                  # The batch processor's "Queue full, dropping span.", once a span while a receiver is down.
                  "opentelemetry.sdk._shared_internal")
MOST_STATUS_CHARACTERS = 256  # of a span's status description: the messages quote what clients send
MOST_ATTRIBUTE_CHARACTERS = 256
HTTP_PATH = "/v1/traces"  # an endpoint whose path ends so is OTLP over HTTP; any other, OTLP over gRPC


def endpoint(configured: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Where spans go: the flag, else the SDK's own variables; None: tracing is off."""
    return (configured or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def over_http(url: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """OTLP over HTTP where the SDK's protocol variable says so or the URL's path is .../v1/traces; else gRPC."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol:
        return protocol.startswith("http")
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and parsed.path.rstrip("/").endswith(HTTP_PATH)


@dataclass
class CallTrace:
    """One call's server span, and what its path recorded for the child spans."""

    span: Span
    tracer: Tracer
    batches: BatchAnchors
    started_ns: int = field(default_factory=time.time_ns)
    admitted_ns: int = 0  # validated and decoded: handed to an engine
    answered_ns: int = 0  # the engine's answers back
    outputs: Sequence[ImageOutput] = ()
    runs: str = ""  # how the engine's batches run (its runner, precision, sizes)

    def admitted(self) -> None:
        self.admitted_ns = time.time_ns()

    def answered(self, outputs: Sequence[ImageOutput], runs: str) -> None:
        self.answered_ns, self.outputs, self.runs = time.time_ns(), outputs, runs

    @contextmanager
    def current(self) -> Iterator[None]:
        """The span current while the call runs: log lines written meanwhile carry its ids."""
        from opentelemetry import trace

        with trace.use_span(self.span, end_on_exit=False):
            yield

    @property
    def traceparent(self) -> str:
        context = self.span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def finish(self, code: str, message: str = "") -> None:
        """End the call's span with its status, its children built from what was recorded."""
        from opentelemetry.trace import Status, StatusCode

        ended = time.time_ns()
        self._children(ended)
        self.span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
        if code != "OK":
            self.span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"[:MOST_STATUS_CHARACTERS]))
        self.span.end(ended)

    def _children(self, ended: int) -> None:
        parent = _in_context(self.span)  # one context for every child
        if self.admitted_ns:
            self._child(parent, "decode", self.started_ns, self.admitted_ns)
        if not self.outputs:
            return
        slowest = max(self.outputs, key=lambda output: output.queue_seconds + output.timing.total)
        compute_start = self.answered_ns - int(slowest.timing.total * 1e9)
        queue_start = compute_start - int(slowest.queue_seconds * 1e9)
        self._child(parent, "queue", queue_start, compute_start)
        # What describes the batch goes on its compute span alone, the call's own on the server span: every
        # attribute is encoded for export in this process, so none is written twice.
        batch_id = f"{slowest.device}/{slowest.batch}"
        timing = slowest.timing
        anchor = self.batches.first_of(batch_id)
        compute = self._child(parent, "compute", compute_start, self.answered_ns, {
            "resnet.batch.id": batch_id, "resnet.batch.size": slowest.batch_size,
            "resnet.batch.buckets": list(slowest.buckets), "resnet.runner": self.runs,
            "resnet.compute.input_ms": timing.input * 1e3, "resnet.compute.infer_ms": timing.infer * 1e3,
            "resnet.compute.output_ms": timing.output * 1e3}, anchor)
        if anchor is None:
            self.batches.remember(batch_id, compute.get_span_context())
        self._child(parent, "answer", self.answered_ns, ended)
        self.span.set_attributes({"resnet.device": slowest.device, "resnet.images": len(self.outputs),
                                  "resnet.temperature": slowest.temperature, "resnet.top_k": len(slowest.top_k),
                                  "resnet.weights.version": slowest.weights_version})

    def _child(self, parent: Context, name: str, start: int, end: int, attributes: dict[str, Any] | None = None,
               linked: SpanContext | None = None) -> Span:
        from opentelemetry import trace

        links = [trace.Link(linked, {"resnet.link": "same batch"})] if linked is not None else None
        child = self.tracer.start_span(name, parent, start_time=start, attributes=attributes, links=links)
        child.end(end)
        return child


def _in_context(span: Span) -> Context:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


class BatchAnchors:
    """The compute span of the first call of each recent batch that this front-end traced: the compute spans of
    the batch's other traced calls link to it. A link, not a shared parent: each call keeps its own trace (its
    caller's), and a batch of calls from many traces is still one click from any of them. Bounded: a batch's
    answers all arrive within moments, so only the latest batches are kept."""

    def __init__(self, keep: int = 1024) -> None:
        self._keep = keep
        self._first: OrderedDict[str, SpanContext] = OrderedDict()

    def first_of(self, batch_id: str) -> SpanContext | None:
        return self._first.get(batch_id)

    def remember(self, batch_id: str, context: SpanContext) -> None:
        self._first[batch_id] = context
        if len(self._first) > self._keep:
            self._first.popitem(last=False)


# Triton's trace settings (TraceSetting) as this server honours them: trace_level OFF or TIMESTAMPS (its spans
# carry their times: Triton's TENSORS is not offered), trace_rate one in N, trace_count the traces left (-1: no
# limit); log_frequency and trace_file are accepted and ignored (spans go to the OTLP receiver, not to a file).
TRACE_LEVELS = ("OFF", "TIMESTAMPS")
IGNORED_SETTINGS = ("log_frequency", "trace_file", "trace_mode")


MOST_SHOWN = 32  # characters of a client's value a refusal shows


def _shown(values: list[str]) -> str:
    """A client's list of values as a refusal shows it: how many, and the first one cut."""
    first = f"{values[0][:MOST_SHOWN]!r}" if values else "none"
    return f"{len(values)} value{'s' if len(values) != 1 else ''}, the first {first}" if len(values) > 1 else first


def checked_settings(asked: dict[str, list[str]]) -> dict[str, list[str]]:
    """The settings a TraceSetting request asks for, checked; InvalidInput names the first it cannot honour."""
    checked = {}
    for key, values in asked.items():
        if key in IGNORED_SETTINGS:
            continue
        if key == "trace_level":
            if len(values) != 1 or values[0] not in TRACE_LEVELS:
                raise InvalidInput(f"trace_level must be one value, OFF or TIMESTAMPS, got {_shown(values)}")
        elif key in ("trace_rate", "trace_count"):
            least = 1 if key == "trace_rate" else -1
            if len(values) != 1 or not values[0].lstrip("-").isdigit() or int(values[0]) < least:
                raise InvalidInput(f"{key} must be one whole number of at least {least}, got {_shown(values)}")
        else:
            raise InvalidInput(f"unknown trace setting {key[:MOST_SHOWN]!r}; this server takes trace_level, "
                               "trace_rate and trace_count (and accepts, ignoring them, "
                               f"{', '.join(IGNORED_SETTINGS)})")
        checked[key] = list(values)
    return checked


class _Sampler:
    """Which calls are traced, its level, rate and count changeable while serving (TraceSetting). A call with a
    caller's context follows its sampled flag (the SDK's parent-based sampler); one without is drawn at ``rate``
    before any span is made (``draw``: an unsampled call then costs a random number, not an SDK span)."""

    def __init__(self, rate: float) -> None:
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

        self.on, self.rate, self.count = True, rate, -1
        self._delegate = ParentBased(ALWAYS_ON)  # a root span reaches it only once drawn

    def draw(self) -> bool:
        """Whether a call without a caller's context is traced."""
        return self.on and self.count != 0 and random.random() < self.rate

    def update(self, settings: dict[str, list[str]]) -> None:
        if "trace_level" in settings:
            self.on = "TIMESTAMPS" in settings["trace_level"]
        if "trace_rate" in settings:
            self.rate = 1 / int(settings["trace_rate"][0])
        if "trace_count" in settings:
            self.count = int(settings["trace_count"][0])

    def settings(self) -> dict[str, list[str]]:
        return {"trace_level": ["TIMESTAMPS" if self.on else "OFF"],
                "trace_rate": [str(round(1 / self.rate)) if self.rate else "0"],
                "trace_count": [str(self.count)], "log_frequency": ["0"], "trace_mode": ["opentelemetry"]}

    def should_sample(self, *args: Any, **kwargs: Any) -> Any:
        from opentelemetry.sdk.trace.sampling import Decision, SamplingResult

        if not self.on or self.count == 0:
            return SamplingResult(Decision.DROP)
        result = self._delegate.should_sample(*args, **kwargs)
        if result.decision.is_sampled() and self.count > 0:
            self.count -= 1
        return result

    def get_description(self) -> str:
        return f"resnet({self._delegate.get_description()})"


class Tracing:
    """A front-end's tracer, built only when tracing is on (``Tracing.start`` for the configuration)."""

    def __init__(self, provider: TracerProvider, address: str, sampler: _Sampler) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.sampler = sampler
        self._provider = provider
        self._tracer = provider.get_tracer("resnet_server")
        host, _, port = address.rpartition(":")
        self._server: dict[str, Any] = {"rpc.system": "grpc", "server.address": host, "server.port": int(port or 0)}
        self._propagator = TraceContextTextMapPropagator()
        self._export_warnings = _OncePerInterval(EXPORT_WARNING_SECONDS)
        self._batches = BatchAnchors()
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(self._export_warnings)

    @classmethod
    def start(cls, configured: str | None, rate: float, address: str) -> Tracing | None:
        """None when no endpoint is named; else the SDK set up to export there (``address``: this server's, for
        the spans' server.address)."""
        url = endpoint(configured)
        if url is None:
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", DEFAULT_SERVICE_NAME)})
        sampler = _Sampler(rate)
        provider = TracerProvider(resource=resource, sampler=sampler,  # type: ignore[arg-type]  # a Sampler by shape
                                  span_limits=SpanLimits(max_attribute_length=MOST_ATTRIBUTE_CHARACTERS))
        provider.add_span_processor(BatchSpanProcessor(_exporter(url)))
        log.info("tracing: spans to %s over %s, calls without a parent sampled at %g", url,
                 "HTTP" if over_http(url) else "gRPC", rate)
        return cls(provider, address, sampler)

    def begin(self, method: str, metadata: Any) -> CallTrace | None:
        """The call's server span, if the call is sampled (None: nothing more is done for it); ended by
        CallTrace.finish."""
        from opentelemetry.trace import SpanKind

        carrier = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate")}
        if "traceparent" not in carrier and not self.sampler.draw():
            return None
        span = self._tracer.start_span(method, self._propagator.extract(carrier), SpanKind.SERVER)
        if not span.is_recording():  # not sampled: a span that records nothing, and needs no end
            return None
        service, _, name = method.rpartition("/")
        span.set_attributes({**self._server, "rpc.service": service, "rpc.method": name,
                             "resnet.protocol": current_protocol.get()})
        return CallTrace(span, self._tracer, self._batches)

    def shutdown(self) -> None:
        """Export what is left (the batch processor's queue), then stop."""
        self._provider.shutdown()
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).removeFilter(self._export_warnings)


async def traced(tracing: Tracing | None, method: str, context: grpc.aio.ServicerContext,
                 work: Callable[[CallTrace | None], Awaitable[T]], unary: bool = True) -> T:
    """``work(trace)`` in the call's span (``work(None)`` with tracing off: nothing else runs); a unary call's
    answer carries the span's ``traceparent`` in its trailing metadata."""
    if tracing is None or (trace := tracing.begin(method, context.invocation_metadata())) is None:
        return await work(None)
    with trace.current():
        if unary:
            context.set_trailing_metadata((("traceparent", trace.traceparent),))
        try:
            result = await work(trace)
        except BaseException as exc:
            code = outcome(exc)
            trace.finish(code, str(exc))
            raise
        trace.finish("OK")
        return result


class _OncePerInterval(logging.Filter):
    """A receiver that is down makes the exporter log every failed export: one line a minute is enough, as a
    warning (spans are dropped; no call fails)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._seconds, self._next = seconds, 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._seconds
        said = record.getMessage()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = f"tracing: %s (spans are dropped; the next such line in {self._seconds:g}s at the earliest)"
        record.args = (said,)
        return True


def _exporter(url: str) -> Any:
    if over_http(url):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=url)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    parsed = urlparse(url if "//" in url else f"//{url}")
    return GrpcExporter(endpoint=parsed.netloc, insecure=parsed.scheme != "https")

