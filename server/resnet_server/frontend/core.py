"""The transport-independent core: validate, decode off the loop, route, batch, await.

Both gRPC APIs (our own ``resnet.v1`` and the Open Inference Protocol) call
:meth:`Dispatcher.classify`; it also records the per-device request metrics, so every
path is measured the same way.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from resnet_server.common.device_decode import defer_or_preprocess
from resnet_server.common.errors import (
    DeadlineExpired,
    InvalidImages,
    InvalidInput,
    Unavailable,
    outcome,
)
from resnet_server.common.logs import current_protocol
from resnet_server.common.metrics import Metrics
from resnet_server.common.preprocess import ImageInput, RawImage, check_header, check_raw, preprocess
from resnet_server.common.shapes import NUM_CLASSES
from resnet_server.common.threads import use_torch_threads
from resnet_server.common.work import ImageOutput, ModelInput, WorkItem
from resnet_server.frontend.fair_share import EVERYONE, CallerId
from resnet_server.frontend.router import EngineHandle, Router
from resnet_server.frontend.tracing import CallTrace

DEFAULT_TOP_K = 5


@dataclass(frozen=True)
class Limits:
    max_images_per_request: int
    max_pixels: int


@dataclass(frozen=True)
class ClassifyCall:
    images: Sequence[ImageInput]
    temperature: float | None = None  # None: the served default
    top_k: int | None = None  # None: DEFAULT_TOP_K
    timeout: float | None = None  # seconds left before the caller's deadline
    request_id: str = ""
    trace: CallTrace | None = None  # its span, with tracing on (resnet_server.frontend.tracing)
    client: CallerId = EVERYONE  # whose share of the device it takes (resnet_server.frontend.fair_share)
    priority: int = 0  # its rank among its client's calls: 1 first, then 2, ...; 0 after them


def cheap_problems(images: Sequence[ImageInput], max_pixels: int) -> dict[int, str]:
    """Each image's reason for refusal that costs no decoding, by its index in the request: a raw tensor's
    dtype, shape, length and values; an encoded image's emptiness and declared size. Found before the
    capacity check, so that bad input is INVALID_ARGUMENT whatever the load (not a RESOURCE_EXHAUSTED that
    tells its caller to send it again)."""
    invalid = {}
    for index, image in enumerate(images):
        try:
            if isinstance(image, RawImage):
                check_raw(image, max_pixels)
            else:
                check_header(image.data, max_pixels)
        except InvalidInput as exc:
            invalid[index] = str(exc)
    return invalid


def decoder_for(image: ImageInput, replica: EngineHandle) -> Callable | None:
    """What turns an image into what the replica's slab takes, run off the loop; None for raw pixels that fit
    a slot as they are (the engine converts them with their batch)."""
    fits = len(image.data) <= replica.inline_bytes
    if isinstance(image, RawImage):
        return None if fits else preprocess
    return defer_or_preprocess if replica.decode_on_device and fits else preprocess


class Dispatcher:
    def __init__(self, router: Router, metrics: Metrics, limits: Limits, default_temperature: float,
                 preprocess_threads: int, on_no_replica_left: Callable[[], None] = lambda: None,
                 client_of: Callable[[Any], CallerId] = lambda context: EVERYONE) -> None:
        self.router = router
        self.client_of = client_of  # a call's caller, from its context (resnet_server.frontend.fair_share)
        # Called (on the event loop) whenever a call finds every replica out of rotation.
        self._on_no_replica_left = on_no_replica_left
        self.limits = limits
        self.default_temperature = default_temperature
        self.unloaded: str | None = None  # why calls are refused UNAVAILABLE: the model is unloaded
        self._metrics = metrics
        # Made on the loop that serves: asking for the running loop costs a system call each time (getpid, on
        # Python 3.11), and a call asked for it twice.
        self._loop = asyncio.get_running_loop()
        self._children: dict[tuple, object] = {}  # by (metric, *labels): see _series
        # Preprocessing threads run torch ops one-threaded: an OpenMP team per thread would compete with
        # the engines' forward passes for the same cores.
        self._executor = ThreadPoolExecutor(preprocess_threads, thread_name_prefix="preprocess",
                                            initializer=use_torch_threads, initargs=(1,))

    async def classify(self, call: ClassifyCall) -> list[ImageOutput]:
        """Classify every image of one call on one replica; raises ServingError subclasses."""
        started = time.monotonic()
        if self.unloaded is not None:
            raise Unavailable(self.unloaded)
        try:
            replica = self.router.choose()
        except Unavailable:
            self._on_no_replica_left()
            raise
        in_flight = self._series(self._metrics.in_flight, replica.name)
        in_flight.inc()
        caller_images = self._series(self._metrics.caller_images_in_flight, call.client.label)
        caller_images.inc(len(call.images))
        replica.pending += len(call.images)
        code, outputs, counted = "OK", None, len(call.images)
        try:
            outputs = await self._classify_on(replica, call, started)
            if call.trace is not None:
                call.trace.answered(outputs, replica.runs)
        except BaseException as exc:
            code = outcome(exc)
            if isinstance(exc, InvalidImages):  # the valid ones were not served: their caller may send them again
                counted = len(exc.reasons)
            if not self.router.any_healthy():  # this call's failure may have evicted the last replica
                self._on_no_replica_left()
            raise
        finally:
            replica.pending -= len(call.images)
            in_flight.dec()
            caller_images.dec(len(call.images))
            self._series(self._metrics.caller_images, call.client.label, code).inc(counted)
            protocol = current_protocol.get()
            self._series(self._metrics.requests, replica.name, code, protocol).inc()
            self._series(self._metrics.images, replica.name, code).inc(counted)
            elapsed = time.monotonic() - started
            self._series(self._metrics.request_latency, replica.name, protocol).observe(elapsed)
            self._metrics.statistics.record_request(elapsed, outputs)
        return outputs

    async def _classify_on(self, replica: EngineHandle, call: ClassifyCall, started: float) -> list[ImageOutput]:
        temperature, k = self._validate(call)
        deadline = None if call.timeout is None else started + call.timeout
        model_inputs = await self._admit(call.images, replica, call.client.key)
        if call.trace is not None:
            call.trace.admitted()
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExpired("deadline passed while the images were decoded")
        items = [WorkItem(model_input, temperature, k, deadline, self._loop.create_future(), call.request_id,
                          client=call.client.key, weight=call.client.weight, priority=call.priority)
                 for model_input in model_inputs]
        replica.submit(items)
        try:
            if len(items) == 1:  # most calls: no gathering future and its callbacks
                return [await items[0].caller]
            return list(await asyncio.gather(*(item.caller for item in items)))
        except BaseException:
            replica.withdraw(items)  # a cancelled call frees its queue slots at once
            for item in items:
                item.caller.cancel()
            raise

    def _series(self, metric, *labels: str):
        """``metric.labels(*labels)``, kept: prometheus_client takes a lock and builds a key on every lookup."""
        key = (metric, *labels)  # metrics hash by identity, and live as long as the process
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _validate(self, call: ClassifyCall) -> tuple[float, int]:
        if not call.images:
            raise InvalidInput("request has no images")
        if len(call.images) > self.limits.max_images_per_request:
            raise InvalidInput(
                f"request has {len(call.images)} images, over the limit of {self.limits.max_images_per_request}"
            )
        temperature = self.default_temperature if call.temperature is None else call.temperature
        if not math.isfinite(temperature) or temperature <= 0:
            raise InvalidInput(f"temperature must be finite and > 0, got {temperature}")
        k = DEFAULT_TOP_K if call.top_k is None else call.top_k
        if not 1 <= k <= NUM_CLASSES:
            raise InvalidInput(f"top_k must be between 1 and {NUM_CLASSES}, got {k}")
        return temperature, k

    async def _admit(self, images: Sequence[ImageInput], replica: EngineHandle, client: str) -> list[ModelInput]:
        """Raw tensors are checked here and converted later, with their batch, on the replica; encoded
        images are decoded (or, to be decoded on the device, header-checked) in the preprocessing threads. An
        image too large to hand an engine process as it came (its slab's ``inline_bytes``) is preprocessed
        here, in those threads; for an engine on a GPU only as far as its uint8 crop, which the engine
        normalises with its batch (``takes_crops``)."""
        # Every invalid image's reason, so the caller can drop just those (those its decoding finds: a second
        # refusal, once the first ones are dropped).
        invalid = cheap_problems(images, self.limits.max_pixels)
        if invalid:  # refused before anything is decoded: a refused call costs no decoding
            raise InvalidImages(invalid, len(images))
        work = [(i, decode) for i, image in enumerate(images) if (decode := decoder_for(image, replica)) is not None]
        # Raw pixels that fit their slots go as they came; every other image is decoded.
        admitted: dict[int, ModelInput] = {i: image for i, image in enumerate(images) if isinstance(image, RawImage)}
        if not work:  # nothing to decode (most calls)
            return [admitted[index] for index in range(len(images))]
        # A call that would be refused is refused before it is decoded (submit() decides for the rest).
        with replica.room_for(len(images), client):
            decoded = await self._decode(images, work, replica.takes_crops)
        for (index, _), model_input in zip(work, decoded, strict=True):
            if isinstance(model_input, InvalidInput):
                invalid[index] = str(model_input)
            elif isinstance(model_input, BaseException):
                raise model_input
            else:
                admitted[index] = model_input
        if invalid:
            raise InvalidImages(invalid, len(images))
        return [admitted[index] for index in range(len(images))]

    async def _decode(self, images: Sequence[ImageInput], work: list[tuple[int, Callable]],
                      crop_only: bool) -> list[ModelInput | BaseException]:
        """Each (index, decoder) of ``work`` run in the preprocessing threads; a failure is returned, not raised."""
        return await asyncio.gather(*(self._loop.run_in_executor(self._executor, decode, images[i],
                                                                 self.limits.max_pixels, crop_only)
                                      for i, decode in work), return_exceptions=True)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
