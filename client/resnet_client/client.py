"""Client and AsyncClient: classify, stream, model info and health, each call with a timeout."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .api import classifier_pb2 as pb
from .api import classifier_pb2_grpc as pb_grpc
from .api import grpc_predict_v2_pb2 as oip
from .api import grpc_predict_v2_pb2_grpc as oip_grpc
from .channel import DEFAULT_ATTEMPTS, ChannelConfig, parse_targets
from .errors import ClassifierError
from .messages import Classification, ImageLike, build_request, parse_response
from .shared_memory import SharedMemory
from .trace_context import outgoing, trace_id

DEFAULT_TIMEOUT = 30.0
MODEL = "resnet18"
# What grpc.intercept_channel takes: an interceptor of any of the four call shapes.
Interceptor = (grpc.UnaryUnaryClientInterceptor | grpc.UnaryStreamClientInterceptor
               | grpc.StreamUnaryClientInterceptor | grpc.StreamStreamClientInterceptor)


def _connect(channels, target, tls_ca, tls_cert, tls_key, token, attempts, own_connection, **extra):
    """(config, channel) from ``grpc`` or ``grpc.aio`` (both spell the channel constructors alike; ``extra``
    goes to grpc.aio's)."""
    config = ChannelConfig(parse_targets(target), tls_ca, tls_cert, tls_key, token, attempts, own_connection)
    credentials = config.credentials()
    if credentials is None:
        return config, channels.insecure_channel(config.target, config.options(), **extra)
    return config, channels.secure_channel(config.target, credentials, config.options(), **extra)


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class Client:
    """Blocking client. ``target`` is ``host:port``, a comma-separated list, a list, or ``dns:///name:port``;
    ``attempts``: tries per classifier call on UNAVAILABLE; ``own_connection``: a connection not shared with
    the process's other clients of the same target (see :class:`client.channel.ChannelConfig`);
    ``interceptors``: gRPC client interceptors (``grpc.UnaryUnaryClientInterceptor`` and its kin) that every
    call passes through, for tracing or logging of your own. Every call carries the caller's OpenTelemetry context
    where ``opentelemetry-api`` is installed; ``trace``: a call without one starts a trace of its own, sampled,
    and each Classification names the server's trace id."""

    def __init__(self, target: str | Sequence[str] = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, attempts: int = DEFAULT_ATTEMPTS, own_connection: bool = False,
                 interceptors: Sequence[Interceptor] = (), trace: bool = False) -> None:
        self._trace = trace
        self._config, channel = _connect(grpc, target, tls_ca, tls_cert, tls_key, token, attempts, own_connection)
        self._channel = grpc.intercept_channel(channel, *interceptors) if interceptors else channel
        self.timeout = timeout
        self._stub = pb_grpc.ClassifierStub(self._channel)
        self._oip = oip_grpc.GRPCInferenceServiceStub(self._channel)  # OIP: reload, shared memory
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout or self.timeout,
                          metadata=[*self._config.metadata(), *outgoing(self._trace)])
        except grpc.RpcError as error:
            raise ClassifierError.from_rpc_error(error) from None

    def classify(self, images: Iterable[ImageLike], *, top_k: int | None = None, temperature: float | None = None,
                 full: bool = False, logits: bool = False, timeout: float | None = None,
                 priority: int = 0) -> list[Classification]:
        """``priority``: its rank among this caller's own requests waiting for the device (1 first; 0 after)."""
        request = build_request(images, top_k=top_k, temperature=temperature, full=full, logits=logits,
                                priority=priority)
        response, call = self._call(self._stub.Classify.with_call, request, timeout)
        return parse_response(response, trace_id(call.trailing_metadata()))

    def classify_stream(self, requests: Iterable[pb.ClassifyRequest], *,
                        timeout: float | None = None) -> Iterator[list[Classification]]:
        """Pipelined: yields each request's results in order (build requests with messages.build_request)."""
        responses = self._call(self._stub.ClassifyStream, iter(requests), timeout)
        try:
            for response in responses:
                yield parse_response(response)
        except grpc.RpcError as error:
            raise ClassifierError.from_rpc_error(error) from None

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The serving status name, e.g. ``SERVING`` or ``NOT_SERVING``."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return _health_name(response.status)

    def reload(self, weights: bytes | None = None, *, timeout: float | None = None) -> None:
        """New weights while the server serves (it runs with ``--model-control explicit``): ``weights`` (a
        ResNet18 state_dict saved by torch.save, a safetensors file, or an ONNX model where the server serves one),
        or, with none, its ``--weights`` read
        again. Returns once every device serves them; ClassifierError says why none does."""
        self._call(self._oip.RepositoryModelLoad, reload_request(weights), timeout)

    def shared_memory(self, byte_size: int, *, mode: int = 0o600) -> SharedMemory:
        """A region of ``byte_size`` bytes under /dev/shm, registered with the server (on this machine, run with
        ``--allow-client-shm``): its ``classify`` sends no image bytes over gRPC. Close it (or use it as a context
        manager) to unregister and remove it. ``mode``: the file's permissions (the server's user must be able
        to read and write it)."""
        return SharedMemory(self._call, self._oip, byte_size, mode)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of :class:`Client` (grpc.aio; its ``interceptors`` are ``grpc.aio``'s kinds), the
    caller's OpenTelemetry context and ``trace`` alike."""

    def __init__(self, target: str | Sequence[str] = "localhost:50051", *, timeout: float = DEFAULT_TIMEOUT,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, attempts: int = DEFAULT_ATTEMPTS, own_connection: bool = False,
                 interceptors: Sequence[Interceptor] = (), trace: bool = False) -> None:
        self._trace = trace
        self._config, self._channel = _connect(grpc.aio, target, tls_ca, tls_cert, tls_key, token, attempts,
                                               own_connection, interceptors=list(interceptors) or None)
        self.timeout = timeout
        self._stub = pb_grpc.ClassifierStub(self._channel)
        self._oip = oip_grpc.GRPCInferenceServiceStub(self._channel)  # OIP: reload, shared memory
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _call(self, method, request, timeout: float | None, answer_trace: list[str] | None = None):
        """``answer_trace``: where to put the trace id the server's answer names."""
        try:
            call = method(request, timeout=timeout or self.timeout,
                          metadata=[*self._config.metadata(), *outgoing(self._trace)])
            response = await call
            if answer_trace is not None:
                answer_trace.append(trace_id(await call.trailing_metadata()))
            return response
        except grpc.RpcError as error:
            raise ClassifierError.from_rpc_error(error) from None

    async def classify(self, images: Iterable[ImageLike], *, top_k: int | None = None,
                       temperature: float | None = None, full: bool = False, logits: bool = False,
                       timeout: float | None = None, priority: int = 0) -> list[Classification]:
        request = build_request(images, top_k=top_k, temperature=temperature, full=full, logits=logits,
                                priority=priority)
        traced: list[str] = []
        response = await self._call(self._stub.Classify, request, timeout, traced)
        return parse_response(response, *traced)

    async def classify_stream(self, requests: Iterable[pb.ClassifyRequest], *,
                              timeout: float | None = None) -> AsyncIterator[list[Classification]]:
        call = self._stub.ClassifyStream(iter(requests), timeout=timeout or self.timeout,
                                         metadata=[*self._config.metadata(), *outgoing(self._trace)])
        try:
            async for response in call:
                yield parse_response(response)
        except grpc.RpcError as error:
            raise ClassifierError.from_rpc_error(error) from None

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def reload(self, weights: bytes | None = None, *, timeout: float | None = None) -> None:
        """As Client.reload."""
        await self._call(self._oip.RepositoryModelLoad, reload_request(weights), timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        response = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return _health_name(response.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def reload_request(weights: bytes | None) -> oip.RepositoryModelLoadRequest:
    """Triton's load of the model, with the file of weights as tritonclient's load_model(files=...) sends it."""
    files = {"file:1/weights": oip.ModelRepositoryParameter(bytes_param=weights)} if weights is not None else {}
    return oip.RepositoryModelLoadRequest(model_name=MODEL, parameters=files)
