"""The HTTP front-end: the Open Inference Protocol's REST API (KServe v2, with Triton's binary tensors and its
extensions) and the project's own API as JSON, on aiohttp, on the same event loop as gRPC.

Each route translates its URL and body into the message the gRPC method takes, checks it against the same
bounds, and calls the same servicer method (resnet_server.frontend.oip_service, .classifier_service): one set
of rules, whichever protocol carries a call. What a method raises is answered here, once, as the HTTP status
its kind maps to, with ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import typing
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.common.errors import ErrorKind, InvalidImages, InvalidInput, ServingError, caller_error
from resnet_server.common.logs import current_protocol, current_request
from resnet_server.frontend.bounds import MOST_CONFIG_BYTES, OverBound, WireBounds, check
from resnet_server.frontend.classifier_service import ClassifierService
from resnet_server.frontend.classify_request import read_classify_request
from resnet_server.frontend.http_tensors import HEADER_LENGTH, check_counts, infer_answer, read_infer_body
from resnet_server.frontend.oip_service import InferenceService, InferRequest
from resnet_server.frontend.repository_service import FILE_PREFIX, read_load_request
from resnet_server.frontend.request_ids import call_id
from resnet_server.frontend.security import token_is_valid

log = logging.getLogger(__name__)

# One mapping from a domain error's kind to the HTTP status a client expects (gRPC's is by name).
HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400, ErrorKind.FAILED_PRECONDITION: 400, ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.PERMISSION_DENIED: 403, ErrorKind.NOT_FOUND: 404, ErrorKind.ALREADY_EXISTS: 409,
    ErrorKind.RESOURCE_EXHAUSTED: 429, ErrorKind.INTERNAL: 500, ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.UNAVAILABLE: 503, ErrorKind.DEADLINE_EXCEEDED: 504,
}
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})  # orchestrators' probes carry no token
BODY_SECONDS = 30.0  # a body still arriving after this is a slow client's: refused (408), its slot freed
KEEPALIVE_SECONDS = 75.0  # an idle keep-alive connection is closed after this
_JSON = "application/json"


class HttpContext:
    """What the servicer methods read of a gRPC call's context, from an HTTP request: its headers as metadata
    (token, x-request-id, traceparent), no deadline, and the metadata they answer with, sent back as headers."""

    def __init__(self, request: web.Request) -> None:
        self._metadata = [(key.lower(), value) for key, value in request.headers.items()]
        self.answered: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, pairs: Iterable[tuple[str, str]]) -> None:
        self.answered = list(pairs)

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self.answered

    def done(self) -> bool:
        return False


def error_response(exc: BaseException) -> web.Response:
    """``exc`` answered with its kind's status; one not raised on purpose is logged with the request id, which its
    message gives the caller."""
    kind, message = caller_error(exc)
    if not isinstance(exc, ServingError):
        rid = current_request.get()
        log.error("request %s failed unexpectedly", rid, exc_info=exc)
        message = f"{message} (request id {rid})"
    body: dict[str, Any] = {"error": message}
    if isinstance(exc, InvalidImages):
        body["invalid_images"] = list(exc.reasons)
    return web.json_response(body, status=HTTP_STATUS[kind], dumps=_dumps)


def _dumps(value: object) -> str:
    return msgspec.json.encode(value).decode()


def as_json(message: Message) -> dict[str, Any]:
    """A message in protobuf's JSON mapping with its field names as declared, but 64-bit integers as numbers (as
    Triton's REST API writes them, where the mapping writes strings)."""
    return _numbers(message, json_format.MessageToDict(message, preserving_proto_field_name=True))


_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}


def _numbers(message: Message, shown: dict[str, Any]) -> dict[str, Any]:
    for field, value in message.ListFields():
        name = field.name
        if name not in shown:
            continue
        if field.cpp_type in _INT64:
            shown[name] = [int(v) for v in shown[name]] if field.is_repeated else int(shown[name])
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                shown[name] = {key: _numbers(value[key], shown[name][key]) for key in shown[name]}
            elif value_field.cpp_type in _INT64:
                shown[name] = {key: int(item) for key, item in shown[name].items()}
        elif field.message_type is not None:
            if field.is_repeated:
                shown[name] = [_numbers(item, entry) for item, entry in zip(value, shown[name], strict=True)]
            else:
                shown[name] = _numbers(value, shown[name])
    return shown


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

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready() else 400)  # KServe: 200 is true, a 4xx false

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelReadyRequest(name=name, version=version))
        answer = await self.inference.ModelReady(asked, HttpContext(request))
        return web.Response(status=200 if answer.ready and self.ready() else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(await self.inference.ServerMetadata(oip.ServerMetadataRequest(), HttpContext(request)))

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelMetadataRequest(name=name, version=version))
        return _json(await self.inference.ModelMetadata(asked, HttpContext(request)))

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        asked = self._read(oip.ModelConfigRequest(name=name, version=version))
        return web.json_response(as_json((await self.inference.ModelConfig(asked, HttpContext(request))).config),
                                 dumps=_dumps)

    async def model_statistics(self, request: web.Request) -> web.Response:
        name, version = request.match_info.get("model", ""), request.match_info.get("version", "")
        asked = self._read(oip.ModelStatisticsRequest(name=name, version=version))
        return _json(await self.inference.ModelStatistics(asked, HttpContext(request)))

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        body = await read_body(request, self.most_body_bytes)
        read = await _off_the_loop_if_large(body, read_infer_body, body, request.headers.get(HEADER_LENGTH), name,
                                            version)
        message = self._read(read.message)
        context = HttpContext(request)
        response = await self.inference.ModelInfer(InferRequest(message, read.raw_input_contents), context)
        answer, json_length = infer_answer(response, read.binary_outputs, read.all_binary)
        headers = dict(context.answered)
        if json_length is None:
            return web.Response(body=answer, content_type=_JSON, headers=headers)
        headers[HEADER_LENGTH] = str(json_length)
        return web.Response(body=answer, content_type="application/octet-stream", headers=headers)

    async def repository_index(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        asked = self._read(oip.RepositoryIndexRequest(ready=body.get("ready") is True))
        index = await self.inference.RepositoryIndex(asked, HttpContext(request))
        return web.json_response([as_json(model) for model in index.models], dumps=_dumps)

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
        await self.inference.RepositoryModelLoad(self._read(message, read_load_request), HttpContext(request))
        return web.Response(status=200)

    async def unload(self, request: web.Request) -> web.Response:
        asked = self._read(oip.RepositoryModelUnloadRequest(model_name=request.match_info["model"]))
        await self.inference.RepositoryModelUnload(asked, HttpContext(request))
        return web.Response(status=200)

    async def shm_status(self, request: web.Request) -> web.Response:
        asked = self._read(oip.SystemSharedMemoryStatusRequest(name=request.match_info.get("region", "")))
        status = await self.inference.SystemSharedMemoryStatus(asked, HttpContext(request))
        return web.json_response([as_json(region) for region in status.regions.values()], dumps=_dumps)

    async def shm_register(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            asked = oip.SystemSharedMemoryRegisterRequest(name=request.match_info["region"], key=body.get("key", ""),
                                                         offset=body.get("offset", 0),
                                                         byte_size=body.get("byte_size", 0))
        except (TypeError, ValueError):
            raise InvalidInput("a region is {\"key\": string, \"offset\": bytes, \"byte_size\": bytes}") from None
        await self.inference.SystemSharedMemoryRegister(self._read(asked), HttpContext(request))
        return web.Response(status=200)

    async def shm_unregister(self, request: web.Request) -> web.Response:
        asked = self._read(oip.SystemSharedMemoryUnregisterRequest(name=request.match_info.get("region", "")))
        await self.inference.SystemSharedMemoryUnregister(asked, HttpContext(request))
        return web.Response(status=200)

    async def trace_setting(self, request: web.Request) -> web.Response:
        asked = oip.TraceSettingRequest(model_name=request.match_info.get("model", ""))
        if request.method == "POST":
            for key, value in (await _json_body(request)).items():
                values = value if isinstance(value, list) else [value]
                asked.settings[key].value.extend(str(item) for item in values)
        answer = await self.inference.TraceSetting(self._read(asked), HttpContext(request))
        return web.json_response({key: list(value.value) for key, value in answer.settings.items()}, dumps=_dumps)

    async def classify(self, request: web.Request) -> web.Response:
        """The project's own API: a ClassifyRequest in protobuf's JSON mapping (images' bytes in base64)."""
        body = await read_body(request, self.most_body_bytes)
        asked = await _off_the_loop_if_large(body, self._read_classify, body)
        context = HttpContext(request)
        answer = await self.classifier.Classify(asked, context)
        return web.json_response(json_format.MessageToDict(answer), dumps=_dumps, headers=dict(context.answered))

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
        info = await self.classifier.GetModelInfo(pb.GetModelInfoRequest(), HttpContext(request))
        return web.json_response(json_format.MessageToDict(info), dumps=_dumps)


MOST_BYTES_ON_THE_LOOP = 64 << 10  # a body larger than this is read off the event loop (JSON numbers, base64)


async def _off_the_loop_if_large(body: bytes, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, on a thread when ``body`` is large: a JSON tensor's numbers or an image's base64 take
    milliseconds a megabyte, which the loop's other calls would wait for."""
    if len(body) <= MOST_BYTES_ON_THE_LOOP:
        return read(*args)
    return await asyncio.to_thread(read, *args)


def _json(message: Message) -> web.Response:
    return web.json_response(as_json(message), dumps=_dumps)


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


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length before it is read when it is over ``limit``, and read with a
    deadline (408), so that a slow client holds a connection no longer."""
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length,
                                            text=_dumps({"error": f"the body holds {request.content_length} bytes, "
                                                                  f"over the limit of {limit} (--max-message-mb)"}),
                                            content_type=_JSON)
    try:
        body = await asyncio.wait_for(request.read(), BODY_SECONDS)  # at most the application's client_max_size
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=_dumps({"error": f"the body did not arrive within {BODY_SECONDS:g}s"}),
                                     content_type=_JSON) from None
    if len(body) > limit:  # chunked, with no Content-Length to say so first
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body),
                                            text=_dumps({"error": f"the body is over the limit of {limit} bytes "
                                                                  "(--max-message-mb)"}), content_type=_JSON)
    return body


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


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middlewares(tokens: list[bytes], protect_health: bool) -> list:
    @web.middleware
    async def answered(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route's call: the protocol and request id made current, its token checked, what it raises
        answered as its status."""
        current_protocol.set("http")
        call_id(HttpContext(request))  # type: ignore[arg-type]  # reads its metadata as gRPC's context
        if tokens and (protect_health or request.path not in OPEN_PATHS) and \
                not token_is_valid([("authorization", request.headers.get("Authorization", ""))], tokens):
            return web.json_response({"error": "missing or invalid bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"}, dumps=_dumps)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own (no route, wrong method) answered as JSON too
            if exc.content_type == _JSON:
                raise
            return web.json_response({"error": exc.reason}, status=exc.status, headers={
                key: value for key, value in exc.headers.items() if key.lower() == "allow"}, dumps=_dumps)
        except Exception as exc:  # noqa: BLE001 - answered as its status
            return error_response(exc)
    return [answered]
