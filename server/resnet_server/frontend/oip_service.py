"""The Open Inference Protocol over gRPC (KServe v2, plus Triton's ModelConfig, ModelStreamInfer and extensions).

Same port, same core, same batcher, metrics and error mapping as ``resnet.v1``; this module only translates
messages to and from the codec's tensors (resnet_server.frontend.oip_codec) and Triton's model views
(resnet_server.frontend.triton_model).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_client.api import model_config_pb2 as mc
from resnet_server import __version__
from resnet_server.common.errors import FailedPrecondition, InvalidInput, NotFound, Unavailable
from resnet_server.common.logs import current_request
from resnet_server.common.model import MODEL_NAME
from resnet_server.common.statistics import ModelStatistics
from resnet_server.frontend.core import ClassifyCall, Dispatcher
from resnet_server.frontend.handlers import grpc_status
from resnet_server.frontend.infer_parameters import (
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    priority_parameter,
    region_reference,
    temperature_parameter,
    top_k_parameter,
)
from resnet_server.frontend.oip_codec import (
    DECLARED_INPUTS,
    INPUT_NAME,
    InputTensor,
    OutputTensor,
    RegionOutput,
    answered_version,
    check_model,
    check_rooms_before_compute,
    input_images,
    output_tensors,
    requested_outputs,
    top_k_for,
    write_to_regions,
)
from resnet_server.frontend.repository_service import RepositoryService
from resnet_server.frontend.request_ids import call_id
from resnet_server.frontend.shared_memory_service import SharedMemoryService, cuda_register
from resnet_server.frontend.streams import in_order
from resnet_server.frontend.supervisor_client import SupervisorClient
from resnet_server.frontend.tracing import CallTrace, Tracing, checked_settings, traced
from resnet_server.frontend.triton_model import model_config, model_metadata, model_statistics
from resnet_server.frontend.wire import TooMany, Unreadable, WireError, parse_whole, pull_out

RAW_INPUT_CONTENTS = oip.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
MOST_RAW_INPUT_CONTENTS = 8  # the model takes one input; the reader refuses a request with more entries unread


class InferRequest(NamedTuple):
    """A ModelInferRequest without its ``raw_input_contents``, and those apart: memoryviews of the bytes gRPC
    received (resnet_server.frontend.wire), not two copies; or why it is refused unread (bytes that are no
    ModelInferRequest: protobuf's reason; more raw contents than a request may hold)."""

    message: oip.ModelInferRequest
    raw_input_contents: list
    unreadable: str | None = None

    def size(self) -> int:
        """The bytes it holds: its raw contents and the rest of its message."""
        return sum(len(contents) for contents in self.raw_input_contents) + self.message.ByteSize()


def read_infer_request(data: bytes) -> InferRequest:
    """gRPC's request deserializer for ModelInfer and ModelStreamInfer; it runs on the event loop, so it reads
    no further than MOST_RAW_INPUT_CONTENTS entries (resnet_server.frontend.wire)."""
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


MODEL_INFER, MODEL_STREAM_INFER = "inference.GRPCInferenceService/ModelInfer", \
    "inference.GRPCInferenceService/ModelStreamInfer"  # the spans' names


class InferenceService(oip_grpc.GRPCInferenceServiceServicer):
    """Answers UNAVAILABLE (and ready=false) until :meth:`attach` hands it the loaded core."""

    def __init__(self, statistics: ModelStatistics, control: SupervisorClient, repository: RepositoryService,
                 shared_memory: SharedMemoryService, runtime: str = "torch") -> None:
        self._runtime = runtime  # what runs the forward pass (--runtime): Triton's platform says it
        self._core: Dispatcher | None = None
        self._labels: list[str] = []
        self._info: pb.ModelInfo | None = None
        self._statistics = statistics
        self._control = control
        self._repository = repository
        self.shared_memory = shared_memory
        self.tracing: Tracing | None = None  # set by the FrontendServer when tracing is on

    def attach(self, core: Dispatcher, labels: list[str], info: pb.ModelInfo) -> None:
        self._core, self._labels, self._info = core, labels, info

    def ready(self) -> bool:
        return self._core is not None and self._core.router.any_healthy() and self._core.unloaded is None

    @property
    def _version(self) -> int:
        return self._control.served.version

    def _configs(self) -> dict[str, mc.ModelConfig]:
        if self._info is None:
            return {}
        return {name: model_config(self._info, name, self._control.served.sha256, self._runtime)
                for name in DECLARED_INPUTS}

    async def ServerLive(self, request, context):
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return oip.ServerReadyResponse(ready=self.ready())

    async def ModelReady(self, request, context):
        check_model(request.name, request.version, self._version)
        return oip.ModelReadyResponse(ready=self.ready())

    async def ServerMetadata(self, request, context):
        return oip.ServerMetadataResponse(name="resnet-grpc", version=__version__,
                                          extensions=["binary_tensor_data", "model_configuration", "model_repository",
                                                      "parameters", "statistics", "system_shared_memory", "trace"])

    async def ModelMetadata(self, request, context):
        check_model(request.name, request.version, self._version)
        return model_metadata(request.name, self._version, self._runtime)

    async def ModelConfig(self, request, context):
        check_model(request.name, request.version, self._version)
        return oip.ModelConfigResponse(config=self._configs().get(request.name, mc.ModelConfig()))

    async def ModelStatistics(self, request, context):
        if request.name:  # an empty name asks for every model: this one, once, by its first name
            check_model(request.name, request.version, self._version)
        totals = await asyncio.to_thread(self._statistics.snapshot)  # may wait on a sibling front-end's write
        return oip.ModelStatisticsResponse(model_stats=[model_statistics(totals, request.name or MODEL_NAME,
                                                                         self._version)])

    async def _infer(self, read: InferRequest, context, trace: CallTrace | None = None) -> oip.ModelInferResponse:
        if read.unreadable is not None:
            raise InvalidInput(read.unreadable)
        request = read.message
        check_model(request.model_name, request.model_version, self._version)
        top_k = top_k_parameter(request.parameters)
        names = requested_outputs([output.name for output in request.outputs], top_k is not None)
        top_k = top_k_for(top_k, names)
        if self._core is None:
            raise Unavailable("the model is still loading; retry when the server is ready")
        with contextlib.ExitStack() as regions:  # the regions it names, held open until it is answered
            owner = self._owner(request, context)
            raw = await self._input_contents(request, read.raw_input_contents, owner, regions)
            into_regions = self._output_regions(request, owner, regions)
            images = input_images(input_tensors(request, raw), self._core.limits.max_images_per_request)
            check_rooms_before_compute(into_regions, len(images), top_k)
            call = ClassifyCall(images, temperature_parameter(request.parameters), top_k, context.time_remaining(),
                                current_request.get(), trace, client=self._core.client_of(context),
                                priority=priority_parameter(request.parameters))
            outputs = await self._core.classify(call)
            tensors = output_tensors(outputs, names, self._labels)
            write_to_regions(tensors, into_regions)
            return infer_response(request, answered_version(outputs), tensors, into_regions)

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
                        ) -> dict[str, RegionOutput]:
        """The outputs asked for in a region, by name."""
        into = {}
        for output in request.outputs:
            if (reference := region_reference(output.parameters)) is not None:
                region = regions.enter_context(self.shared_memory.region(reference.region, owner).in_use())
                region.part(reference.offset, reference.byte_size)  # within the region
                into[output.name] = RegionOutput(region, reference.offset, reference.byte_size)
        return into

    async def ModelInfer(self, request, context):
        if request.message.id:
            call_id(context, request.message.id)
        return await traced(self.tracing, MODEL_INFER, context, functools.partial(self._infer, request, context))

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[oip.ModelStreamInferResponse]:
        """Triton's semantics: an error answers that request in the stream; the stream goes on."""
        async def one(request: InferRequest) -> oip.ModelStreamInferResponse:
            call_id(context, request.message.id)  # this request's task's
            try:
                return oip.ModelStreamInferResponse(infer_response=await traced(
                    self.tracing, MODEL_STREAM_INFER, context, functools.partial(self._infer, request, context),
                    unary=False))
            except Exception as exc:  # noqa: BLE001 - answered in the stream
                code, message = grpc_status(exc)
                return oip.ModelStreamInferResponse(
                    error_message=f"[{code.name}] {message}",
                    infer_response=oip.ModelInferResponse(model_name=request.message.model_name,
                                                          id=request.message.id))

        async for response in in_order(request_iterator, one, weigh=InferRequest.size):
            yield response

    async def TraceSetting(self, request, context):
        """Triton's trace settings: each update applies on every front-end at once; with none, what they are."""
        if request.model_name:
            check_model(request.model_name, "", self._version)
        if request.settings:  # entries and values bounded before the request was parsed (resnet_server.frontend.bounds)
            if self.tracing is None:
                raise FailedPrecondition("tracing is off: start the server with --otlp-endpoint (an OTLP receiver) "
                                         "to trace calls")
            asked = {key: list(value.value) for key, value in request.settings.items()}
            await self._control.set_trace(checked_settings(asked))
        current = self.tracing.sampler.settings() if self.tracing is not None else {"trace_level": ["OFF"]}
        value = oip.TraceSettingResponse.SettingValue
        return oip.TraceSettingResponse(settings={key: value(value=values) for key, values in current.items()})

    async def SystemSharedMemoryStatus(self, request, context):
        return self.shared_memory.status(request, context.invocation_metadata())

    async def SystemSharedMemoryRegister(self, request, context):
        await self.shared_memory.register(request, context.invocation_metadata())
        return oip.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self.shared_memory.unregister(request, context.invocation_metadata())
        return oip.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):  # nothing is ever registered
        if request.name:
            raise NotFound(f"no CUDA shared-memory region {request.name!r} is registered")
        return oip.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        cuda_register()

    async def CudaSharedMemoryUnregister(self, request, context):  # perf_analyzer calls it even in system mode
        return oip.CudaSharedMemoryUnregisterResponse()

    async def RepositoryIndex(self, request, context):
        return self._repository.index(request)

    async def RepositoryModelLoad(self, request, context):
        return await self._repository.load(request, self._configs())

    async def RepositoryModelUnload(self, request, context):
        return await self._repository.unload(request)


def input_tensors(request: oip.ModelInferRequest, raw_input_contents: list) -> list[InputTensor]:
    """The request's inputs as the codec's tensors, each with its raw contents if it has them."""
    if len(raw_input_contents) > len(request.inputs):
        raise InvalidInput("raw_input_contents has more entries than inputs")
    return [InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape),
                        raw_input_contents[index] if index < len(raw_input_contents) else None,
                        _typed_contents(tensor)) for index, tensor in enumerate(request.inputs)]


def _typed_contents(tensor: oip.ModelInferRequest.InferInputTensor) -> Sequence:
    contents = tensor.contents
    if tensor.datatype == "BYTES":
        return contents.bytes_contents
    return contents.fp32_contents if tensor.datatype == "FP32" else contents.uint_contents


def infer_response(request: oip.ModelInferRequest, version: int, tensors: list[OutputTensor],
                   into_regions: dict[str, RegionOutput]) -> oip.ModelInferResponse:
    """The answer: each output's bytes in raw_output_contents, or, for one written to a region, as Triton answers
    it: an empty entry there and the region named in the output's parameters."""
    response = oip.ModelInferResponse(model_name=request.model_name, model_version=str(version), id=request.id)
    for tensor in tensors:
        output = response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        place = into_regions.get(tensor.name)
        if place is None:
            response.raw_output_contents.append(tensor.data)
            continue
        response.raw_output_contents.append(b"")
        output.parameters[SHM_REGION].string_param = place.region.spec.name
        output.parameters[SHM_BYTE_SIZE].int64_param = len(tensor.data)
        output.parameters[SHM_OFFSET].int64_param = place.offset
    return response
