"""Thin servicer for ``resnet.v1.Classifier``: protobuf in, core call, protobuf out.

All decisions live in :class:`~resnet_server.frontend.core.Dispatcher`; this module only converts messages
and raises domain errors, which the registration (resnet_server.frontend.handlers) answers as status codes.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import grpc

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_server.common.errors import InvalidInput, Unavailable
from resnet_server.common.logs import current_request
from resnet_server.common.work import ImageOutput
from resnet_server.frontend.classify_request import ReadRequest
from resnet_server.frontend.core import ClassifyCall, Dispatcher
from resnet_server.frontend.fair_share import EVERYONE, CallerId
from resnet_server.frontend.streams import in_order
from resnet_server.frontend.supervisor_client import SupervisorClient
from resnet_server.frontend.tracing import CallTrace, Tracing, traced

_SERVICE = pb.DESCRIPTOR.services_by_name["Classifier"].full_name
CLASSIFY, CLASSIFY_STREAM = f"{_SERVICE}/Classify", f"{_SERVICE}/ClassifyStream"  # the spans' names


def to_call(request: ReadRequest, context: grpc.aio.ServicerContext, trace: CallTrace | None = None,
            client: CallerId = EVERYONE) -> ClassifyCall:
    if request.unreadable is not None:
        raise InvalidInput(request.unreadable)
    fields = request.fields
    return ClassifyCall(
        images=request.images,
        temperature=fields.temperature if fields.HasField("temperature") else None,
        top_k=fields.top_k if fields.HasField("top_k") else None,
        timeout=context.time_remaining(),
        request_id=current_request.get(),
        trace=trace,
        client=client,
        priority=fields.priority,
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

    def __init__(self, control: SupervisorClient) -> None:
        self._core: Dispatcher | None = None
        self._info = pb.ModelInfo()
        self._labels: list[str] = []
        self._control = control
        self.tracing: Tracing | None = None  # set by the FrontendServer when tracing is on

    def attach(self, core: Dispatcher, model_info: pb.ModelInfo) -> None:
        self._core = core
        self._info = model_info
        self._labels = list(model_info.labels)

    def _ready_core(self) -> Dispatcher:
        if self._core is None:
            raise Unavailable("the model is still loading; retry when health reports SERVING")
        return self._core

    async def _classify(self, request: ReadRequest, context, trace: CallTrace | None = None
                        ) -> pb.ClassifyResponse:
        core = self._ready_core()
        outputs = await core.classify(to_call(request, context, trace, core.client_of(context)))
        return pb.ClassifyResponse(results=[to_result(output, self._labels, request.fields) for output in outputs],
                                   weights_version=max(output.weights_version for output in outputs))

    async def Classify(self, request, context):
        return await traced(self.tracing, CLASSIFY, context, functools.partial(self._classify, request, context))

    async def ClassifyStream(self, request_iterator, context) -> AsyncIterator[pb.ClassifyResponse]:
        """Answers in request order; the first failing request ends the stream with its status code."""
        async for response in in_order(request_iterator, lambda request: traced(
                self.tracing, CLASSIFY_STREAM, context, functools.partial(self._classify, request, context),
                unary=False), weigh=ReadRequest.size):
            yield response

    async def GetModelInfo(self, request, context):
        self._ready_core()
        served = self._control.served
        info = pb.ModelInfo()
        info.CopyFrom(self._info)
        info.weights_version, info.weights_sha256 = served.version, served.sha256
        info.weights = self._control.weights_shown(info.weights)
        return info
