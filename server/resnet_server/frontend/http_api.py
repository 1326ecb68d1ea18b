"""The HTTP front-end: the Open Inference Protocol's REST API (KServe v2, with Triton's binary tensors and its
extensions) and the project's own API as JSON, on aiohttp, on the same event loop as gRPC.

Each route translates its URL and body into the message the gRPC method takes, checks it against the same
bounds, and calls the same servicer method (resnet_server.frontend.oip_service, .classifier_service): one set
of rules, whichever protocol carries a call. What a method raises is answered as its HTTP status by
resnet_server.frontend.http_answers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import typing
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.common.errors import InvalidInput
from resnet_server.frontend.bounds import MOST_CONFIG_BYTES, OverBound, WireBounds, check
from resnet_server.frontend.classifier_service import ClassifierService
from resnet_server.frontend.classify_request import read_classify_request
from resnet_server.frontend.http_answers import JSON, context_of, dumps, read_body
from resnet_server.frontend.http_tensors import HEADER_LENGTH, check_counts, infer_answer, read_infer_body
from resnet_server.frontend.oip_service import InferenceService, InferRequest
from resnet_server.frontend.proto_json import as_json
from resnet_server.frontend.repository_service import FILE_PREFIX, read_load_request

KEEPALIVE_SECONDS = 75.0  # an idle keep-alive connection is closed after this


class HttpApi:
    """The routes, over the servicers one front-end serves gRPC with. ``ready``: whether the server takes calls
    (as its gRPC health says); ``bounds``: those its gRPC requests are checked against."""

    def __init__(self, inference: InferenceService, classifier: ClassifierService, ready: Callable[[], bool],
                 bounds: WireBounds, max_images: int, most_body_bytes: int, most_load_bytes: int) -> None:
        self.inference, self.classifier, self.ready = inference, classifier, ready
        self.bounds, self.max_images = bounds, max_images
        self.most_body_bytes = most_body_bytes  # --max-message-mb
        self.most_load_bytes = most_load_bytes  # a file of weights in base64, with --model-control explicit

    def routes(self) -> list[web.RouteDef]:
        model = "/v2/models/{model}"
        versioned = (model, model + "/versions/{version}")
        return [
            web.get("/v2/health/live", self.live), web.get("/v2/health/ready", self.server_ready),
            web.get("/v2", self.server_metadata),
            *[route for path in versioned for route in (
                web.get(path, self.model_metadata), web.get(path + "/ready", self.model_ready),
                web.get(path + "/config", self.model_config), web.get(path + "/stats", self.model_statistics),
                web.post(path + "/infer", self.infer))],
            web.get("/v2/models/stats", self.model_statistics),
            web.post("/v2/repository/index", self.repository_index),
            web.post("/v2/repository/models/{model}/load", self.load),
            web.post("/v2/repository/models/{model}/unload", self.unload),
            web.get("/v2/systemsharedmemory/status", self.shm_status),
            web.get("/v2/systemsharedmemory/region/{region}/status", self.shm_status),
            web.post("/v2/systemsharedmemory/region/{region}/register", self.shm_register),
            web.post("/v2/systemsharedmemory/unregister", self.shm_unregister),
            web.post("/v2/systemsharedmemory/region/{region}/unregister", self.shm_unregister),
            web.get("/v2/trace/setting", self.trace_setting), web.post("/v2/trace/setting", self.trace_setting),
            web.get(model + "/trace/setting", self.trace_setting),
            web.post(model + "/trace/setting", self.trace_setting),
            web.post("/v1/classify", self.classify), web.get("/v1/model", self.model_info),
        ]

    def _read(self, message: Message, reader: Callable[[bytes], Any] | None = None) -> Any:
        """``message`` as its gRPC method would receive it: checked against the same bounds, read by the same
        reader."""
        data = message.SerializeToString()
        try:
            check(typing.cast(Descriptor, message.DESCRIPTOR), data, self.bounds)  # upb's is protobuf's
        except OverBound as exc:
            raise InvalidInput(str(exc)) from None
        return reader(data) if reader is not None else message

    # Health says itself twice, as KServe's own server answers it: in the status (200 true, 503 false: what probes,
    # balancers and tritonclient read) and in the body (what the KServe SDK reads).
    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True}, dumps=dumps)

    async def server_ready(self, request: web.Request) -> web.Response:
        return _readiness({}, self.ready())

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelReadyRequest(name=name, version=version))
        answer = await self.inference.ModelReady(asked, context_of(request))
        return _readiness({"name": name}, answer.ready and self.ready())

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(await self.inference.ServerMetadata(oip.ServerMetadataRequest(), context_of(request)))

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelMetadataRequest(name=name, version=version))
        return _json(await self.inference.ModelMetadata(asked, context_of(request)))

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelConfigRequest(name=name, version=version))
        return web.json_response(as_json((await self.inference.ModelConfig(asked, context_of(request))).config),
                                 dumps=dumps)

    async def model_statistics(self, request: web.Request) -> web.Response:
        name, version = request.match_info.get("model", ""), request.match_info.get("version", "")
        asked = self._read(oip.ModelStatisticsRequest(name=name, version=version))
        return _json(await self.inference.ModelStatistics(asked, context_of(request)))

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        body = await read_body(request, self.most_body_bytes)
        read = await _off_the_loop_if_large(body, read_infer_body, body, request.headers.get(HEADER_LENGTH), name,
                                            version)
        message = self._read(read.message)
        context = context_of(request)
        response = await self.inference.ModelInfer(InferRequest(message, read.raw_input_contents), context)
        answer, json_length = infer_answer(response, read.binary_outputs, read.all_binary)
        headers = dict(context.answered)
        if json_length is None:
            return web.Response(body=answer, content_type=JSON, headers=headers)
        headers[HEADER_LENGTH] = str(json_length)
        return web.Response(body=answer, content_type="application/octet-stream", headers=headers)

    async def repository_index(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        asked = self._read(oip.RepositoryIndexRequest(ready=body.get("ready") is True))
        index = await self.inference.RepositoryIndex(asked, context_of(request))
        return web.json_response([as_json(model) for model in index.models], dumps=dumps)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.most_load_bytes)
        check_counts(body, values=True)
        try:
            parameters = msgspec.json.decode(body or b"{}", type=_LoadBody).parameters
        except (msgspec.DecodeError, RecursionError):
            raise InvalidInput("the body is not {\"parameters\": {name: string}}") from None
        message = oip.RepositoryModelLoadRequest(model_name=request.match_info["model"])
        for key, value in parameters.items():
            _load_parameter(message, key, value)
        await self.inference.RepositoryModelLoad(self._read(message, read_load_request), context_of(request))
        return web.Response(status=200)

    async def unload(self, request: web.Request) -> web.Response:
        asked = self._read(oip.RepositoryModelUnloadRequest(model_name=request.match_info["model"]))
        await self.inference.RepositoryModelUnload(asked, context_of(request))
        return web.Response(status=200)

    async def shm_status(self, request: web.Request) -> web.Response:
        asked = self._read(oip.SystemSharedMemoryStatusRequest(name=request.match_info.get("region", "")))
        status = await self.inference.SystemSharedMemoryStatus(asked, context_of(request))
        return web.json_response([as_json(region) for region in status.regions.values()], dumps=dumps)

    async def shm_register(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            asked = oip.SystemSharedMemoryRegisterRequest(name=request.match_info["region"], key=body.get("key", ""),
                                                         offset=body.get("offset", 0),
                                                         byte_size=body.get("byte_size", 0))
        except (TypeError, ValueError):
            raise InvalidInput("a region is {\"key\": string, \"offset\": bytes, \"byte_size\": bytes}") from None
        await self.inference.SystemSharedMemoryRegister(self._read(asked), context_of(request))
        return web.Response(status=200)

    async def shm_unregister(self, request: web.Request) -> web.Response:
        asked = self._read(oip.SystemSharedMemoryUnregisterRequest(name=request.match_info.get("region", "")))
        await self.inference.SystemSharedMemoryUnregister(asked, context_of(request))
        return web.Response(status=200)

    async def trace_setting(self, request: web.Request) -> web.Response:
        asked = oip.TraceSettingRequest(model_name=request.match_info.get("model", ""))
        if request.method == "POST":
            for key, value in (await _json_body(request)).items():
                values = value if isinstance(value, list) else [value]
                asked.settings[key].value.extend(str(item) for item in values)
        answer = await self.inference.TraceSetting(self._read(asked), context_of(request))
        return web.json_response({key: list(value.value) for key, value in answer.settings.items()}, dumps=dumps)

    async def classify(self, request: web.Request) -> web.Response:
        """The project's own API: a ClassifyRequest in protobuf's JSON mapping (images' bytes in base64)."""
        body = await read_body(request, self.most_body_bytes)
        asked = await _off_the_loop_if_large(body, self._read_classify, body)
        context = context_of(request)
        answer = await self.classifier.Classify(asked, context)
        return web.json_response(json_format.MessageToDict(answer), dumps=dumps, headers=dict(context.answered))

    def _read_classify(self, body: bytes) -> Any:
        check_counts(body, values=True)
        try:
            message = json_format.Parse(body, pb.ClassifyRequest(), max_recursion_depth=8)
        except RecursionError:
            raise InvalidInput("the body's JSON nests too deep") from None
        except json_format.ParseError as exc:
            raise InvalidInput(f"the body is not a ClassifyRequest in JSON: {str(exc)[:200]}") from None
        return self._read(message, lambda data: read_classify_request(data, self.max_images))

    async def model_info(self, request: web.Request) -> web.Response:
        info = await self.classifier.GetModelInfo(pb.GetModelInfoRequest(), context_of(request))
        return web.json_response(json_format.MessageToDict(info), dumps=dumps)


MOST_BYTES_ON_THE_LOOP = 64 << 10  # a body larger than this is read off the event loop (JSON numbers, base64)


async def _off_the_loop_if_large(body: bytes, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, on a thread when ``body`` is large: a JSON tensor's numbers or an image's base64 take
    milliseconds a megabyte, which the loop's other calls would wait for."""
    if len(body) <= MOST_BYTES_ON_THE_LOOP:
        return read(*args)
    return await asyncio.to_thread(read, *args)


def _readiness(about: dict[str, Any], ready: bool) -> web.Response:
    return web.json_response({**about, "ready": ready}, status=200 if ready else 503, dumps=dumps)


def _json(message: Message) -> web.Response:
    return web.json_response(as_json(message), dumps=dumps)


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _load_parameter(message: oip.RepositoryModelLoadRequest, key: str, value: str) -> None:
    """A load request's parameter: the config (a string), or a file's bytes in base64 (tritonclient.http's
    ``files``)."""
    if not key.startswith(FILE_PREFIX):
        message.parameters[key].string_param = value
        return
    try:
        message.parameters[key].bytes_param = base64.b64decode(value, validate=True)
    except binascii.Error:
        raise InvalidInput(f"parameter {key[:64]!r} is not base64") from None


class _LoadBody(msgspec.Struct):
    parameters: dict[str, str] = {}


async def _json_body(request: web.Request) -> dict[str, Any]:
    """A small JSON object (an extension's request, at most MOST_CONFIG_BYTES); an empty body is an empty
    object."""
    body = await read_body(request, MOST_CONFIG_BYTES)
    if not body.strip():
        return {}
    check_counts(body, values=True)
    try:
        value = msgspec.json.decode(body, type=dict[str, Any])
    except RecursionError:
        raise InvalidInput("the body's JSON nests too deep") from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"the body is not a JSON object: {str(exc)[:200]}") from None
    return value


