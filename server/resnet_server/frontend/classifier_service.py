"""Thin servicer for ``resnet.v1.Classifier``: protobuf in, core call, protobuf out.

All decisions live in :class:`~server.frontend.core.InferenceCore`; this module only converts
messages and turns domain errors into gRPC status codes through :func:`server.common.errors.status_for`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.errors import INVALID_IMAGES_KEY  # the client reads it; it installs without torch
from resnet_server.common.errors import InvalidImages, InvalidInput, ServingError, Unavailable, status_for
from resnet_server.common.work import ImageOutput
from resnet_server.frontend.classify_request import ReadRequest
from resnet_server.frontend.core import ClassifyCall, InferenceCore
from resnet_server.frontend.model_control import ModelControl
from resnet_server.frontend.tracing import CallTrace, Tracing, traced

log = logging.getLogger("server.service")
_SERVICE = pb.DESCRIPTOR.services_by_name["Classifier"].full_name
CLASSIFY, CLASSIFY_STREAM = f"{_SERVICE}/Classify", f"{_SERVICE}/ClassifyStream"  # the spans' names
T = TypeVar("T")
R = TypeVar("R")
# Fresh request ids: this process's random prefix and a count, unique across processes and restarts (as a
# uuid4 is) at a fifth of its cost, which every call without an x-request-id pays.
_ID_PREFIX = os.urandom(4).hex()
_ID_COUNT = itertools.count()


MOST_ID_CHARACTERS = 64
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def request_id(context: grpc.aio.ServicerContext, given: str = "") -> str:
    """The id the caller gave (a ModelInferRequest's ``id``), else its x-request-id, else a fresh one: for the
    logs, INTERNAL messages and the engine. A caller's id is cut to MOST_ID_CHARACTERS and anything but printable
    ASCII becomes ``?``, so that no id costs more than that once per image, nor forges a line in a text log."""
    if not given:
        given = next((str(value) for key, value in context.invocation_metadata() or () if key == "x-request-id"), "")
    if given:
        return _UNPRINTABLE.sub("?", given[:MOST_ID_CHARACTERS])
    return f"{_ID_PREFIX}{next(_ID_COUNT):08x}"


async def answer(context: grpc.aio.ServicerContext, rid: str, work: Callable[[], Awaitable[T]]) -> T:
    """Run the work; abort the call with the mapped status code if it raises."""
    try:
        return await work()
    except Exception as exc:
        await abort_with(context, rid, exc)
        raise  # abort raises; this line only satisfies type checkers


def caller_status(rid: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """Map an exception for the caller; unexpected ones are logged with the request id."""
    code, message = status_for(exc)
    if not isinstance(exc, ServingError):
        log.error("request %s failed unexpectedly", rid, exc_info=exc)
        message = f"{message} (request id {rid})"
    return code, message


async def abort_with(context: grpc.aio.ServicerContext, rid: str, exc: Exception) -> None:
    remaining = context.time_remaining()
    if context.done() or (remaining is not None and remaining <= 0):
        # The caller is gone (cancelled, or its deadline passed): there is no one to answer, and
        # grpc refuses to send a status on a finished call.
        raise asyncio.CancelledError(f"request {rid} ended before its answer") from exc
    if isinstance(exc, InvalidImages):  # beside what is set already (a traceparent)
        context.set_trailing_metadata((*(context.trailing_metadata() or ()),
                                       (INVALID_IMAGES_KEY, ",".join(map(str, exc.reasons)))))
    await context.abort(*caller_status(rid, exc))


STREAM_WINDOW = 64  # requests of one stream started and not yet answered: past it, the stream's reader waits
STREAM_WINDOW_BYTES = 64 << 20  # and the bytes those requests and their answers hold


_TAKEN = -1


class _HeldBytes:
    """The bytes a stream's window holds; the reader waits for room while they are over the bound."""

    def __init__(self, most: int) -> None:
        self.most, self.held = most, 0
        self._released = asyncio.Event()

    async def room(self) -> None:
        """Until the window holds no more than its bound (one request always goes: an empty window has room)."""
        while self.held > self.most:
            self._released.clear()
            await self._released.wait()

    def add(self, count: int) -> None:
        self.held += count

    def release(self, count: int) -> None:
        self.held -= count
        self._released.set()


def message_bytes(message: object) -> int:
    """An answer's size on the wire (a protobuf message's)."""
    byte_size = getattr(message, "ByteSize", None)
    return int(byte_size()) if byte_size is not None else 0


async def in_order(requests: AsyncIterator[R], handle: Callable[[R], Awaitable[T]],
                   weigh: Callable[[R], int] = lambda _: 0) -> AsyncIterator[T]:
    """Start handle(request) for each request as it arrives and yield the results in request order. The server's
    queue (--max-queue) bounds the images in flight, refusing the excess at once as it refuses unary calls; and
    a stream's window holds at most STREAM_WINDOW requests started and unanswered, and STREAM_WINDOW_BYTES of
    them (``weigh``: a request's bytes) and of their answers: a client that sends and does not read its answers
    finds the stream's reading paused (gRPC's flow control then holds its sends), not its answers piling up in
    the server."""
    pending: asyncio.Queue[tuple[asyncio.Task, int] | None] = asyncio.Queue(STREAM_WINDOW)
    held = _HeldBytes(STREAM_WINDOW_BYTES)
    answer_bytes: dict[asyncio.Task, int] = {}  # answers held, by task; TAKEN: yielded before it was weighed

    def weigh_answer(task: asyncio.Task) -> None:
        if answer_bytes.pop(task, None) == _TAKEN or task.cancelled() or task.exception() is not None:
            return
        answer_bytes[task] = size = message_bytes(task.result())
        held.add(size)

    async def read_requests() -> None:
        try:
            async for request in requests:
                await held.room()
                size = weigh(request)
                held.add(size)
                task = asyncio.ensure_future(handle(request))
                task.add_done_callback(weigh_answer)
                await pending.put((task, size))
        finally:
            await pending.put(None)  # the writer stops here; `await reader` then re-raises any error

    reader = asyncio.create_task(read_requests())
    try:
        while (started := await pending.get()) is not None:
            task, size = started
            result = await task
            weighed = answer_bytes.pop(task, None)  # None: done, its callback not run yet (it will not count it)
            if weighed is None:
                answer_bytes[task] = _TAKEN
            held.release(size + (weighed or 0))
            yield result
        await reader
    finally:
        reader.cancel()
        while not pending.empty():
            if (left := pending.get_nowait()) is not None:
                left[0].cancel()


def to_call(request: ReadRequest, context: grpc.aio.ServicerContext, rid: str,
            trace: CallTrace | None = None) -> ClassifyCall:
    if request.unreadable is not None:
        raise InvalidInput(request.unreadable)
    fields = request.fields
    return ClassifyCall(
        images=request.images,
        temperature=fields.temperature if fields.HasField("temperature") else None,
        top_k=fields.top_k if fields.HasField("top_k") else None,
        timeout=context.time_remaining(),
        request_id=rid,
        trace=trace,
    )


def to_result(output: ImageOutput, labels: list[str], request: pb.ClassifyRequest) -> pb.ImageResult:
    result = pb.ImageResult(
        top_k=[pb.ClassScore(index=i, label=labels[i], probability=p) for i, p in output.top_k],
        queue_ms=output.queue_seconds * 1000.0,
        compute_ms=output.timing.total * 1000.0,
        device=output.device,
        temperature=output.temperature,
    )
    if request.return_probabilities:
        result.probabilities.extend(output.probabilities.tolist())
    if request.return_logits:
        result.logits.extend(output.logits.tolist())
    return result


class ClassifierService(pb_grpc.ClassifierServicer):
    """Answers UNAVAILABLE until :meth:`attach` hands it the loaded core."""

    def __init__(self, control: ModelControl) -> None:
        self._core: InferenceCore | None = None
        self._info = pb.ModelInfo()
        self._labels: list[str] = []
        self._control = control
        self.tracing: Tracing | None = None  # set by the App when tracing is on

    def attach(self, core: InferenceCore, model_info: pb.ModelInfo) -> None:
        self._core = core
        self._info = model_info
        self._labels = list(model_info.labels)

    def _ready_core(self) -> InferenceCore:
        if self._core is None:
            raise Unavailable("the model is still loading; retry when health reports SERVING")
        return self._core

    async def _classify(self, request: ReadRequest, context, rid: str, trace: CallTrace | None = None
                        ) -> pb.ClassifyResponse:
        outputs = await self._ready_core().classify(to_call(request, context, rid, trace))
        return pb.ClassifyResponse(results=[to_result(output, self._labels, request.fields) for output in outputs],
                                   weights_version=max(output.weights_version for output in outputs))

    async def Classify(self, request, context):
        rid = request_id(context)
        return await answer(context, rid, lambda: traced(self.tracing, CLASSIFY, context, functools.partial(
            self._classify, request, context, rid)))

    async def ClassifyStream(self, request_iterator, context) -> AsyncIterator[pb.ClassifyResponse]:
        """Answers in request order; the first failing request ends the stream with its status code."""
        rid = request_id(context)
        try:
            async for response in in_order(request_iterator, lambda request: traced(
                    self.tracing, CLASSIFY_STREAM, context, functools.partial(self._classify, request, context, rid),
                    unary=False), weigh=ReadRequest.size):
                yield response
        except Exception as exc:
            await abort_with(context, rid, exc)

    async def GetModelInfo(self, request, context):
        return await answer(context, request_id(context), self._model_info)

    async def _model_info(self) -> pb.ModelInfo:
        self._ready_core()
        served = self._control.served
        info = pb.ModelInfo()
        info.CopyFrom(self._info)
        info.weights_version, info.weights_sha256 = served.version, served.sha256
        info.weights = self._control.weights_shown(info.weights)
        return info
