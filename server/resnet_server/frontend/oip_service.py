"""The Open Inference Protocol (KServe v2 gRPC, plus Triton's ModelConfig and ModelStreamInfer).

Same port, same core, same batcher, metrics and error mapping as ``resnet.v1``; this module only
translates tensors. Input ``input`` (one per request): FP32 [N, 3, 224, 224] normalised, UINT8
[N, H, W, 3] raw RGB, or BYTES [N] encoded images, in ``raw_input_contents`` or typed ``contents``.
The model answers to two names, ``resnet18`` (whose metadata declares the FP32 input) and ``resnet18_uint8``
(declaring UINT8): each takes all three, and tools that build requests from the declaration pick one by name.
Outputs: ``probabilities`` FP32 [N, 1000] and, when ``top_k`` is asked, ``top_k_indices`` INT64,
``top_k_probabilities`` FP32 and ``top_k_labels`` BYTES, each [N, K], in ``raw_output_contents``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import struct
from collections.abc import AsyncIterator
from typing import NamedTuple

import numpy as np

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_client.api import model_config_pb2 as mc
from resnet_server import __version__
from resnet_server.common.errors import FailedPrecondition, InvalidInput, NotFound, Unavailable
from resnet_server.common.model import MODEL_NAME
from resnet_server.common.preprocess import CROP, EncodedImage, ImageInput, RawImage
from resnet_server.common.statistics import BatchTotals, Duration, ModelStatistics, Totals
from resnet_server.common.work import ImageOutput
from resnet_server.frontend.classifier_service import answer, caller_status, in_order, request_id
from resnet_server.frontend.core import DEFAULT_TOP_K, ClassifyCall, InferenceCore
from resnet_server.frontend.infer_parameters import (
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    region_reference,
    temperature_parameter,
    top_k_parameter,
)
from resnet_server.frontend.model_control import ModelControl
from resnet_server.frontend.repository_service import RepositoryService
from resnet_server.frontend.shared_memory import Region
from resnet_server.frontend.shared_memory_service import SharedMemoryService, cuda_register
from resnet_server.frontend.tracing import CallTrace, Tracing, checked_settings, traced
from resnet_server.frontend.wire import TooMany, Unreadable, WireError, parse_whole, pull_out

INPUT_NAME = "input"
PROBABILITIES = "probabilities"
TOP_K_OUTPUTS = ("top_k_indices", "top_k_probabilities", "top_k_labels")
OUTPUT_TYPES = {PROBABILITIES: "FP32", "top_k_indices": "INT64", "top_k_probabilities": "FP32",
                "top_k_labels": "BYTES"}
RAW_INPUT_CONTENTS = oip.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
MOST_RAW_INPUT_CONTENTS = 8  # the model takes one input; the reader refuses a request with more entries unread


class DeclaredInput(NamedTuple):
    """The input ModelMetadata and ModelConfig declare under one of the model's names."""

    datatype: str
    shape: tuple[int, ...]  # the batch dimension first; -1 where any size goes
    config_type: mc.DataType
    config_format: mc.ModelInput.Format


# One model, one statistics, several names; every name accepts every input form. perf_analyzer sends what
# the declaration says: FP32 makes it send 600 KB of floats an image, UINT8 (with --shape input:224,224,3)
# the 150 KB of pixels our own bench sends.
DECLARED_INPUTS = {
    MODEL_NAME: DeclaredInput("FP32", (-1, 3, CROP, CROP), mc.TYPE_FP32, mc.ModelInput.FORMAT_NCHW),
    f"{MODEL_NAME}_uint8": DeclaredInput("UINT8", (-1, -1, -1, 3), mc.TYPE_UINT8, mc.ModelInput.FORMAT_NHWC),
}


class InferRequest(NamedTuple):
    """A ModelInferRequest without its ``raw_input_contents``, and those apart: memoryviews of the bytes gRPC
    received (server.frontend.wire), not two copies; or why it is refused unread (bytes that are no
    ModelInferRequest: protobuf's reason; more raw contents than a request may hold)."""

    message: oip.ModelInferRequest
    raw_input_contents: list
    unreadable: str | None = None

    def size(self) -> int:
        """The bytes it holds: its raw contents and the rest of its message."""
        return sum(len(contents) for contents in self.raw_input_contents) + self.message.ByteSize()


def read_infer_request(data: bytes) -> InferRequest:
    """gRPC's request deserializer for ModelInfer and ModelStreamInfer; it runs on the event loop, so it reads
    no further than MOST_RAW_INPUT_CONTENTS entries (server.frontend.wire)."""
    view = memoryview(data)
    try:
        return InferRequest(*pull_out(oip.ModelInferRequest, view, 0, len(view), RAW_INPUT_CONTENTS,
                                      MOST_RAW_INPUT_CONTENTS))
    except TooMany:
        return _refused(f"raw_input_contents has more than {MOST_RAW_INPUT_CONTENTS} entries; the model takes one "
                        f"input, {INPUT_NAME!r}")
    except WireError as exc:
        walk_error = exc
    try:
        message = parse_whole(oip.ModelInferRequest, data, walk_error)
    except Unreadable as exc:
        return _refused(str(exc))
    contents = list(message.raw_input_contents)
    del message.raw_input_contents[:]
    return InferRequest(message, contents)


def _refused(reason: str) -> InferRequest:
    return InferRequest(oip.ModelInferRequest(), [], reason)


def check_model(name: str, version: str, served: int) -> None:
    """The model's name, and its version if one is asked for: the weights served now (``served``)."""
    if name not in DECLARED_INPUTS:
        raise NotFound(f"unknown model {name!r}; this server serves {' and '.join(map(repr, DECLARED_INPUTS))}")
    if version not in ("", str(served)):
        raise NotFound(f"version {version!r} of {name} is not served; version {served} is (each reload of the "
                       "weights serves the next)")


def parse_bytes_tensor(raw: bytes, most: int) -> list[bytes]:
    """Triton's BYTES wire format: each element is a 4-byte little-endian length, then the bytes; more than
    ``most`` elements are refused without reading on."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(elements) == most:
            raise _too_many_elements(most)
        if offset + 4 > len(raw):
            raise InvalidInput("BYTES input is malformed: a 4-byte length prefix is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput("BYTES input is malformed: an element is shorter than its length prefix")
        elements.append(bytes(raw[offset:offset + length]))  # decoders take bytes
        offset += length
    return elements


def _too_many_elements(most: int) -> InvalidInput:
    return InvalidInput(f"BYTES input holds more than {most} elements, the limit of images a request")


def serialize_bytes_tensor(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def input_images(request: oip.ModelInferRequest, raw_input_contents: list, max_images: int) -> list[ImageInput]:
    """Split the request's one input tensor into per-image inputs for the core; more than ``max_images`` images
    are refused before any is made."""
    if len(request.inputs) != 1 or request.inputs[0].name != INPUT_NAME:
        names = [tensor.name[:64] for tensor in request.inputs[:8]]  # a flood of inputs is not echoed back
        raise InvalidInput(f"expected exactly one input named {INPUT_NAME!r}, got {len(request.inputs)}: {names}")
    tensor = request.inputs[0]
    if len(raw_input_contents) > 1:
        raise InvalidInput("raw_input_contents has more entries than inputs")
    raw = raw_input_contents[0] if raw_input_contents else None
    shape = tuple(tensor.shape)
    if shape and shape[0] > max_images:
        raise InvalidInput(f"input declares {shape[0]} images, over the limit of {max_images} "
                           "(--max-images-per-request)")
    if tensor.datatype == "BYTES":
        return _bytes_images(shape, raw, tensor.contents, max_images)
    if tensor.datatype == "UINT8":
        return _array_images(shape, raw, tensor.contents.uint_contents, np.uint8, "uint8", 4)
    if tensor.datatype == "FP32":
        return _array_images(shape, raw, tensor.contents.fp32_contents, np.float32, "float32", 4)
    raise InvalidInput(f"input datatype must be FP32, UINT8 or BYTES, got {tensor.datatype!r}")


def _bytes_images(shape: tuple[int, ...], raw: bytes | None, contents, max_images: int) -> list[ImageInput]:
    if len(shape) != 1:
        raise InvalidInput(f"BYTES input must have shape [N], got {list(shape)}")
    if raw is None and len(contents.bytes_contents) > max_images:  # counted before they are listed
        raise _too_many_elements(max_images)
    elements = parse_bytes_tensor(raw, max_images) if raw is not None else list(contents.bytes_contents)
    if len(elements) != shape[0]:
        raise InvalidInput(f"BYTES input declares shape {list(shape)} but holds {len(elements)} elements")
    return [EncodedImage(element) for element in elements]


def _array_images(shape, raw, typed, np_type, dtype: str, ndim: int) -> list[ImageInput]:
    """``typed``: the tensor's typed contents (a protobuf repeated field), read only when ``raw`` is None and
    then in one NumPy conversion, not a Python loop over its values."""
    expected = "[N, 3, 224, 224]" if dtype == "float32" else "[N, H, W, 3]"
    if len(shape) != ndim or min(shape, default=0) <= 0:
        raise InvalidInput(f"{dtype} input must have shape {expected}, got {list(shape)}")
    if dtype == "float32" and tuple(shape[1:]) != (3, CROP, CROP):
        raise InvalidInput(f"FP32 input must have shape {expected}, got {list(shape)}")
    count = math.prod(shape)
    if raw is None:
        if len(typed) != count:
            raise InvalidInput(f"input of shape {list(shape)} needs {count} values, got {len(typed)}")
        values = np.array(typed, dtype=np.float32 if dtype == "float32" else np.uint32)
        if dtype == "uint8" and values.size and values.max() > 255:
            raise InvalidInput("UINT8 input holds values above 255")
        raw = values.astype(np_type).tobytes()
    itemsize = np.dtype(np_type).itemsize
    if len(raw) != count * itemsize:
        raise InvalidInput(f"input of shape {list(shape)} needs {count * itemsize} bytes, got {len(raw)}")
    per_image = len(raw) // shape[0]
    return [RawImage(dtype, tuple(shape[1:]), raw[i * per_image:(i + 1) * per_image]) for i in range(shape[0])]


def requested_outputs(request: oip.ModelInferRequest, top_k_asked: bool) -> list[str]:
    names = [output.name for output in request.outputs]
    for name in names:
        if name not in OUTPUT_TYPES:
            raise InvalidInput(f"unknown output {name!r}; outputs are {list(OUTPUT_TYPES)}")
    if names:
        return names
    return [PROBABILITIES, *TOP_K_OUTPUTS] if top_k_asked else [PROBABILITIES]


def build_response(request: oip.ModelInferRequest, outputs: list[ImageOutput], names: list[str],
                   labels: list[str]) -> oip.ModelInferResponse:
    version = max(output.weights_version for output in outputs)  # one version, unless a reload split the call
    response = oip.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    batch = len(outputs)
    k = len(outputs[0].top_k)
    for name in names:
        if name == PROBABILITIES:
            shape, data = [batch, len(outputs[0].probabilities)], _stack_probabilities(outputs)
        elif name == "top_k_indices":
            shape, data = [batch, k], np.array([[i for i, _ in o.top_k] for o in outputs], "<i8").tobytes()
        elif name == "top_k_probabilities":
            shape, data = [batch, k], np.array([[p for _, p in o.top_k] for o in outputs], "<f4").tobytes()
        else:
            shape = [batch, k]
            data = serialize_bytes_tensor([labels[i].encode() for o in outputs for i, _ in o.top_k])
        response.outputs.add(name=name, datatype=OUTPUT_TYPES[name], shape=shape)
        response.raw_output_contents.append(data)
    return response


FIXED_OUTPUT_BYTES = {PROBABILITIES: lambda k: 1000 * 4, "top_k_indices": lambda k: k * 8,
                      "top_k_probabilities": lambda k: k * 4}  # an image's bytes of each output of a fixed size


def check_room(name: str, needed: int, room: int) -> None:
    if needed > room:
        raise InvalidInput(f"output {name!r} needs {needed} bytes; its shared-memory reference gives {room}")


def check_rooms_before_compute(into: dict[str, tuple[Region, int, int]], images: int, top_k: int | None) -> None:
    """The outputs of a known size checked against their regions before the images are computed (the labels'
    size is known only after)."""
    for name, (_, _, room) in into.items():
        if name in FIXED_OUTPUT_BYTES:
            check_room(name, images * FIXED_OUTPUT_BYTES[name](top_k or DEFAULT_TOP_K), room)


def write_to_regions(response: oip.ModelInferResponse, into: dict[str, tuple[Region, int, int]]) -> None:
    """Each output asked for in a region written there, and answered as Triton does: an empty entry in
    raw_output_contents, the region named in the output's parameters."""
    for index, output in enumerate(response.outputs):  # every room checked before any output is written
        if output.name in into:
            check_room(output.name, len(response.raw_output_contents[index]), into[output.name][2])
    for index, output in enumerate(response.outputs):
        if output.name not in into:
            continue
        region, offset, _ = into[output.name]
        data = response.raw_output_contents[index]
        region.write(offset, data)
        response.raw_output_contents[index] = b""
        output.parameters[SHM_REGION].string_param = region.spec.name
        output.parameters[SHM_BYTE_SIZE].int64_param = len(data)
        output.parameters[SHM_OFFSET].int64_param = offset


def _stack_probabilities(outputs: list[ImageOutput]) -> bytes:
    return np.stack([output.probabilities for output in outputs]).astype("<f4").tobytes()


MODEL_INFER, MODEL_STREAM_INFER = "inference.GRPCInferenceService/ModelInfer", \
    "inference.GRPCInferenceService/ModelStreamInfer"  # the spans' names


class InferenceService(oip_grpc.GRPCInferenceServiceServicer):
    """Answers UNAVAILABLE (and ready=false) until :meth:`attach` hands it the loaded core."""

    def __init__(self, statistics: ModelStatistics, control: ModelControl, repository: RepositoryService,
                 shared_memory: SharedMemoryService) -> None:
        self._core: InferenceCore | None = None
        self._labels: list[str] = []
        self._info: pb.ModelInfo | None = None
        self._statistics = statistics
        self._control = control
        self._repository = repository
        self.shared_memory = shared_memory
        self.tracing: Tracing | None = None  # set by the App when tracing is on

    def attach(self, core: InferenceCore, labels: list[str], info: pb.ModelInfo) -> None:
        self._core, self._labels, self._info = core, labels, info

    def _ready(self) -> bool:
        return self._core is not None and self._core.router.any_healthy() and self._core.unloaded is None

    @property
    def _version(self) -> int:
        return self._control.served.version

    def _configs(self) -> dict[str, mc.ModelConfig]:
        if self._info is None:
            return {}
        return {name: model_config(self._info, name, self._control.served.sha256) for name in DECLARED_INPUTS}

    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        async def ready():
            check_model(request.name, request.version, self._version)
            return oip.ModelReadyResponse(ready=self._ready())
        return await answer(context, request_id(context), ready)

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="resnet-grpc", version=__version__,
                                          extensions=["model_configuration", "model_repository", "parameters",
                                                      "statistics", "system_shared_memory", "trace"])

    async def ModelMetadata(self, request, context):
        async def metadata():
            check_model(request.name, request.version, self._version)
            return model_metadata(request.name, self._version)
        return await answer(context, request_id(context), metadata)

    async def ModelConfig(self, request, context):
        async def config():
            check_model(request.name, request.version, self._version)
            return oip.ModelConfigResponse(config=self._configs().get(request.name, mc.ModelConfig()))
        return await answer(context, request_id(context), config)

    async def ModelStatistics(self, request, context):
        async def statistics():
            if request.name:  # an empty name asks for every model: this one, once, by its first name
                check_model(request.name, request.version, self._version)
            totals = await asyncio.to_thread(self._statistics.snapshot)  # may wait on a sibling front-end's write
            return oip.ModelStatisticsResponse(model_stats=[model_statistics(totals, request.name or MODEL_NAME,
                                                                             self._version)])
        return await answer(context, request_id(context), statistics)

    async def _infer(self, read: InferRequest, context, rid: str, trace: CallTrace | None = None
                     ) -> oip.ModelInferResponse:
        if read.unreadable is not None:
            raise InvalidInput(read.unreadable)
        request = read.message
        check_model(request.model_name, request.model_version, self._version)
        top_k = top_k_parameter(request.parameters)
        names = requested_outputs(request, top_k is not None)
        if top_k is None and any(name in TOP_K_OUTPUTS for name in names):
            top_k = DEFAULT_TOP_K
        if self._core is None:
            raise Unavailable("the model is still loading; retry when the server is ready")
        with contextlib.ExitStack() as regions:  # the regions it names, held open until it is answered
            owner = self._owner(request, context)
            raw = await self._input_contents(request, read.raw_input_contents, owner, regions)
            into_regions = self._output_regions(request, owner, regions)
            images = input_images(request, raw, self._core.limits.max_images_per_request)
            check_rooms_before_compute(into_regions, len(images), top_k)
            call = ClassifyCall(images, temperature_parameter(request.parameters),
                                top_k, context.time_remaining(), rid, trace)
            outputs = await self._core.classify(call)
            response = build_response(request, outputs, names, self._labels)
            write_to_regions(response, into_regions)
            return response

    def _owner(self, request: oip.ModelInferRequest, context) -> str:
        """Whose regions the request may name (worked out only for a request that names one)."""
        if not any(SHM_REGION in tensor.parameters for tensor in request.inputs) and \
                not any(SHM_REGION in tensor.parameters for tensor in request.outputs):
            return ""
        return self.shared_memory.owner(context.invocation_metadata())

    async def _input_contents(self, request: oip.ModelInferRequest, raw_input_contents: list, owner: str,
                              regions: contextlib.ExitStack) -> list:
        """The input's bytes: as the request carries them, or where its shared-memory reference says (read into
        the slab later, in one copy; an encoded image's bytes are read now, off the loop, to be decoded: at most
        --max-message-mb of them, as a request carrying them would be)."""
        reference = region_reference(request.inputs[0].parameters) if len(request.inputs) == 1 else None
        if reference is None:
            return raw_input_contents
        if raw_input_contents:
            raise InvalidInput(f"input {INPUT_NAME!r} names shared-memory region {reference.region!r} and carries "
                               "raw_input_contents too")
        datatype = request.inputs[0].datatype
        region = regions.enter_context(self.shared_memory.region(reference.region, owner).in_use())
        data = region.part(reference.offset, reference.byte_size, finite_float32=datatype == "FP32")
        if datatype != "BYTES":
            return [data]
        if reference.byte_size > self.shared_memory.most_encoded_bytes:
            raise InvalidInput(f"a BYTES input of {reference.byte_size} bytes from a shared-memory region, over the "
                               f"{self.shared_memory.most_encoded_bytes} a request may carry (--max-message-mb)")
        return [await asyncio.to_thread(data.read)]

    def _output_regions(self, request: oip.ModelInferRequest, owner: str, regions: contextlib.ExitStack
                        ) -> dict[str, tuple[Region, int, int]]:
        """The outputs asked for in a region: by name, the region, the offset and the bytes there."""
        into = {}
        for output in request.outputs:
            if (reference := region_reference(output.parameters)) is not None:
                region = regions.enter_context(self.shared_memory.region(reference.region, owner).in_use())
                region.part(reference.offset, reference.byte_size)  # within the region
                into[output.name] = (region, reference.offset, reference.byte_size)
        return into

    async def ModelInfer(self, request, context):
        rid = request_id(context, request.message.id)
        return await answer(context, rid, lambda: traced(self.tracing, MODEL_INFER, context, functools.partial(
            self._infer, request, context, rid)))

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[oip.ModelStreamInferResponse]:
        """Triton's semantics: an error answers that request in the stream; the stream goes on."""
        async def one(request: InferRequest) -> oip.ModelStreamInferResponse:
            rid = request_id(context, request.message.id)
            try:
                return oip.ModelStreamInferResponse(infer_response=await traced(
                    self.tracing, MODEL_STREAM_INFER, context, functools.partial(self._infer, request, context, rid),
                    unary=False))
            except Exception as exc:
                code, message = caller_status(rid, exc)
                return oip.ModelStreamInferResponse(
                    error_message=f"[{code.name}] {message}",
                    infer_response=oip.ModelInferResponse(model_name=request.message.model_name,
                                                          id=request.message.id))

        async for response in in_order(request_iterator, one, weigh=InferRequest.size):
            yield response

    async def TraceSetting(self, request, context):
        return await answer(context, request_id(context), lambda: self._trace_setting(request))

    async def _trace_setting(self, request: oip.TraceSettingRequest) -> oip.TraceSettingResponse:
        """Triton's trace settings: each update applies on every front-end at once; with none, what they are."""
        if request.model_name:
            check_model(request.model_name, "", self._version)
        if request.settings:  # entries and values bounded before the request was parsed (server.frontend.bounds)
            if self.tracing is None:
                raise FailedPrecondition("tracing is off: start the server with --otlp-endpoint (an OTLP receiver) "
                                         "to trace calls")
            asked = {key: list(value.value) for key, value in request.settings.items()}
            await self._control.set_trace(checked_settings(asked))
        current = self.tracing.sampler.settings() if self.tracing is not None else {"trace_level": ["OFF"]}
        value = oip.TraceSettingResponse.SettingValue
        return oip.TraceSettingResponse(settings={key: value(value=values) for key, values in current.items()})

    async def SystemSharedMemoryStatus(self, request, context):
        async def status():
            return self.shared_memory.status(request, context.invocation_metadata())
        return await answer(context, request_id(context), status)

    async def SystemSharedMemoryRegister(self, request, context):
        async def register():
            await self.shared_memory.register(request, context.invocation_metadata())
            return oip.SystemSharedMemoryRegisterResponse()
        return await answer(context, request_id(context), register)

    async def SystemSharedMemoryUnregister(self, request, context):
        async def unregister():
            await self.shared_memory.unregister(request, context.invocation_metadata())
            return oip.SystemSharedMemoryUnregisterResponse()
        return await answer(context, request_id(context), unregister)

    async def CudaSharedMemoryStatus(self, request, context):  # nothing is ever registered
        async def status():
            if request.name:
                raise NotFound(f"no CUDA shared-memory region {request.name!r} is registered")
            return oip.CudaSharedMemoryStatusResponse()
        return await answer(context, request_id(context), status)

    async def CudaSharedMemoryRegister(self, request, context):
        async def register():
            cuda_register()
        return await answer(context, request_id(context), register)

    async def CudaSharedMemoryUnregister(self, request, context):  # perf_analyzer calls it even in system mode
        async def unregister():
            return oip.CudaSharedMemoryUnregisterResponse()
        return await answer(context, request_id(context), unregister)

    async def RepositoryIndex(self, request, context):
        async def index():
            return self._repository.index(request)
        return await answer(context, request_id(context), index)

    async def RepositoryModelLoad(self, request, context):
        return await answer(context, request_id(context), lambda: self._repository.load(request, self._configs()))

    async def RepositoryModelUnload(self, request, context):
        return await answer(context, request_id(context), lambda: self._repository.unload(request))


def model_metadata(name: str, version: int) -> oip.ModelMetadataResponse:
    tensor = oip.ModelMetadataResponse.TensorMetadata
    declared = DECLARED_INPUTS[name]
    return oip.ModelMetadataResponse(
        name=name, versions=[str(version)], platform="pytorch_libtorch",
        inputs=[tensor(name=INPUT_NAME, datatype=declared.datatype, shape=declared.shape)],
        outputs=[tensor(name=PROBABILITIES, datatype="FP32", shape=[-1, 1000]),
                 *(tensor(name=output, datatype=OUTPUT_TYPES[output], shape=[-1, -1]) for output in TOP_K_OUTPUTS)],
    )


def model_statistics(totals: Totals, name: str, version: int) -> oip.ModelStatistics:
    def duration(value: Duration) -> oip.StatisticDuration:
        return oip.StatisticDuration(count=value.count, ns=value.ns)

    def compute(value: BatchTotals) -> dict[str, oip.StatisticDuration]:
        return {"compute_input": duration(value.compute_input), "compute_infer": duration(value.compute_infer),
                "compute_output": duration(value.compute_output)}

    return oip.ModelStatistics(
        name=name, version=str(version), last_inference=totals.last_inference_ms,
        inference_count=totals.inference_count, execution_count=totals.execution_count,
        inference_stats=oip.InferStatistics(success=duration(totals.success), fail=duration(totals.fail),
                                            queue=duration(totals.queue), **compute(totals.compute)),
        batch_stats=[oip.InferBatchStatistics(batch_size=size, **compute(totals.batches[size]))
                     for size in sorted(totals.batches)],
    )


def model_config(info: pb.ModelInfo, name: str, weights_sha256: str = "") -> mc.ModelConfig:
    """Triton's view of the served model under ``name``, from the ModelInfo our own API reports; settings
    Triton's config has no field for (the default temperature, the wait for closed-loop callers, the weights'
    SHA-256) go in its parameters."""
    gpus = sorted({int(device.split(":")[1].split("#")[0]) for device in info.devices if device.startswith("cuda")})
    group = (mc.ModelInstanceGroup(name="gpu", kind=mc.ModelInstanceGroup.KIND_GPU, count=1, gpus=gpus) if gpus
             else mc.ModelInstanceGroup(name="cpu", kind=mc.ModelInstanceGroup.KIND_CPU, count=len(info.devices)))
    batching = info.batching
    parameters = {"default_temperature": f"{info.default_temperature:g}",
                  "wait_for_callers_ms": f"{batching.wait_for_callers_ms:g}"}
    if weights_sha256:
        parameters["weights_sha256"] = weights_sha256
    declared = DECLARED_INPUTS[name]
    return mc.ModelConfig(
        name=name, platform="pytorch_libtorch", backend="pytorch",
        max_batch_size=info.input.max_images_per_request,
        input=[mc.ModelInput(name=INPUT_NAME, data_type=declared.config_type, format=declared.config_format,
                             dims=declared.shape[1:])],
        output=[mc.ModelOutput(name=PROBABILITIES, data_type=mc.TYPE_FP32, dims=[1000]),
                mc.ModelOutput(name="top_k_indices", data_type=mc.TYPE_INT64, dims=[-1]),
                mc.ModelOutput(name="top_k_probabilities", data_type=mc.TYPE_FP32, dims=[-1]),
                mc.ModelOutput(name="top_k_labels", data_type=mc.TYPE_STRING, dims=[-1])],
        instance_group=[group],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=[batching.max_batch_size],
            max_queue_delay_microseconds=int(batching.max_batch_delay_ms * 1000)),
        parameters={name: mc.ModelParameter(string_value=value) for name, value in parameters.items()},
    )
