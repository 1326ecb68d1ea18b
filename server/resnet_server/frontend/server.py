"""Wiring: build replicas, the core and the servicers; serve gRPC and /metrics; drain on signals."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.api import grpc_predict_v2_pb2 as oip_pb
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_server import __version__
from resnet_server.boundary.protocol import EngineLink
from resnet_server.common import event_loop
from resnet_server.common.config import host_port
from resnet_server.common.devices import cpu_bf16_unit
from resnet_server.common.errors import StartupError
from resnet_server.common.lifetime import exit_at_once
from resnet_server.common.logs import log_trace_ids
from resnet_server.common.metrics import Metrics
from resnet_server.common.model import IMAGENET_WEIGHTS, MODEL_NAME, MODEL_VERSION
from resnet_server.common.preprocess import ENCODINGS, MEAN, RAW_FORMATS, STD
from resnet_server.common.sections import FrontendConfig
from resnet_server.common.served import ServedWeights
from resnet_server.common.shapes import CROP, RESIZE
from resnet_server.common.threads import use_torch_threads
from resnet_server.frontend.bounds import WireBounds, served_bounds
from resnet_server.frontend.classifier_service import ClassifierService
from resnet_server.frontend.classify_request import read_classify_request
from resnet_server.frontend.core import Dispatcher, Limits
from resnet_server.frontend.engine_client import EngineClient
from resnet_server.frontend.fair_share import callers_by, resolved_mode
from resnet_server.frontend.handlers import registered
from resnet_server.frontend.http_api import HttpApi
from resnet_server.frontend.http_server import HttpListener
from resnet_server.frontend.oip_codec import DECLARED_INPUTS
from resnet_server.frontend.oip_service import MOST_RAW_INPUT_CONTENTS, InferenceService, read_infer_request
from resnet_server.frontend.repository_service import RepositoryService, read_load_request
from resnet_server.frontend.router import EngineHandle, Router
from resnet_server.frontend.security import TokenAuthInterceptor, load_tokens, server_credentials
from resnet_server.frontend.shared_memory_service import SharedMemoryService
from resnet_server.frontend.supervisor_client import SupervisorClient
from resnet_server.frontend.temperature import default_temperature
from resnet_server.frontend.tracing import Tracing

log = logging.getLogger(__name__)
LABELS = list(IMAGENET_WEIGHTS.meta["categories"])
TRACING_FLUSH_SECONDS = 5.0
UNLOADED = "the model is unloaded (RepositoryModelUnload); load it again (RepositoryModelLoad) to serve"
OIP_SERVICE_NAME = oip_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# The services' health says whether they take calls (readiness); the server's own, "", whether the process is
# well (liveness): an unloaded model is the one, not the other.
SERVICE_NAMES = (pb.DESCRIPTOR.services_by_name["Classifier"].full_name, OIP_SERVICE_NAME)


OnBound = Callable[[tuple[int, int]], object]  # hears the gRPC and HTTP ports once bound (0: no HTTP)


class FrontendServer:
    """One front-end process's gRPC server (classifier, OIP, health, reflection) over the engines. ``metrics``: its
    series and statistics, made and served by the caller (resnet_server.frontend.main, or a test reading them)."""

    def __init__(self, config: FrontendConfig, metrics: Metrics, engines: Sequence[EngineLink],
                 owner: int, index: int = 0, control: SupervisorClient | None = None) -> None:
        self.config, self.index = config, index  # this front-end's index among config.frontends
        self.links, self.owner = list(engines), owner  # one engine process per device; its number in their slabs
        self.metrics = metrics
        # Checked before binding, so a bad --temperature-file or TLS file fails at once.
        network = config.network
        self.credentials = server_credentials(network.tls_cert, network.tls_key, network.tls_client_ca)
        self.token_entries = load_tokens(network.auth_token_file)
        self.tokens = [entry.token for entry in self.token_entries]
        self.temperature, self.temperature_source = default_temperature(config)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # grpc-stubs predates grpc.aio
        self.port = 0
        self.core: Dispatcher | None = None
        # What it knows of the weights served, and its way to reload them (none for a front-end run alone).
        self.control = control or SupervisorClient(ServedWeights("", 1), "")
        self.control.on_change(self._weights_changed)
        self.classifier = ClassifierService(self.control)
        repository = RepositoryService(self.control, config.model_control == "explicit", config.max_weights_mb << 20,
                                       list(DECLARED_INPUTS), config.precision)
        self.shared_memory = SharedMemoryService(self.control, config, tokens_on=bool(self.tokens))
        self.inference = InferenceService(self.metrics.statistics, self.control, repository, self.shared_memory,
                                          config.runtime)
        self._server: grpc.aio.Server | None = None
        self.http: HttpListener | None = None  # with --http-port, from bind() on
        self.tracing: Tracing | None = None  # with --otlp-endpoint, from bind() on
        self._no_replica = False  # every replica out of rotation: health went NOT_SERVING
        self._give_up: asyncio.TimerHandle | None = None  # runs out --unhealthy-exit-after seconds after that
        self._draining = False
        # Set by a signal, or when no replica has come back in time; serve() then drains and exits exit_code.
        self.stop_requested = asyncio.Event()
        self.stop_reason = ""
        self.exit_code = 0
        self._health_update: asyncio.Future | None = None  # the latest change of health; held, so it is not collected

    async def start(self, on_bound: OnBound | None = None, load_first: bool = False) -> int:
        """Bind and load: the port answers health checks (NOT_SERVING) while the model loads. ``on_bound``
        hears the ports as soon as they are bound. With ``load_first`` (a front-end replacing one that ended, on a
        port its siblings serve) it loads before it binds, so the kernel hands it no connection it cannot
        answer yet."""
        if load_first:
            await self.load()
        port = await self.bind()
        if on_bound is not None:
            on_bound((port, self.http.port if self.http is not None else 0))
        if not load_first:
            await self.load()
        return port

    def log_serving(self) -> None:
        """The line that says the server is up (scripts and tests wait for it)."""
        config = self.config
        worker = f"; front-end {self.index} of {config.frontends}" if config.frontends > 1 else ""
        devices = ", ".join(engine.name for engine in self.links)
        http = f"HTTP on {host_port(config.network.host, self.http.port)}; " if self.http is not None else ""
        log.info("serving %s on %s (%sdevices %s; event loop %s%s)", MODEL_NAME,
                 host_port(config.network.host, self.port), http, devices, event_loop.resolved(config.event_loop),
                 worker)

    async def bind(self) -> int:
        """Start gRPC, with health NOT_SERVING unless the model is loaded already; until load() is done,
        classification answers UNAVAILABLE."""
        config, network = self.config, self.config.network
        if self.core is None:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        limit = network.max_message_mb << 20
        if config.model_control == "explicit":  # room for a file of weights (inference requests keep the limit)
            limit = max(limit, (config.max_weights_mb + 1) << 20)
        interceptors = [TokenAuthInterceptor(self.tokens, network.auth_health)] if self.tokens else []
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.max_concurrent_streams", network.max_concurrent_streams),
            # The port is shared only among this server's own front-ends. gRPC allows SO_REUSEPORT by default, so
            # a second server started on a port already in use would otherwise take half its connections.
            ("grpc.so_reuseport", int(config.frontends > 1)),
            *_connection_age_options(config),
        ])
        # Requests that carry pixels are read with the pixels left in gRPC's bytes (resnet_server.frontend.wire).
        read_classify = functools.partial(read_classify_request, max_images=config.max_images_per_request)
        bounds = served_bounds(config.max_images_per_request, MOST_RAW_INPUT_CONTENTS)
        # gRPC's limit, raised for a file of weights, still holds for every other method (checked by their readers).
        most_bytes = network.max_message_mb << 20 if limit > network.max_message_mb << 20 else None
        add_servicer(pb_grpc.add_ClassifierServicer_to_server, self.classifier, self._server,
                     _service(pb, "Classifier"), bounds, {"Classify": read_classify, "ClassifyStream": read_classify},
                     most_bytes=most_bytes)
        add_servicer(oip_grpc.add_GRPCInferenceServiceServicer_to_server, self.inference, self._server,
                     _service(oip_pb, "GRPCInferenceService"), bounds,
                     {"ModelInfer": read_infer_request, "ModelStreamInfer": read_infer_request},
                     rare={"RepositoryModelLoad": read_load_request}, most_bytes=most_bytes,
                     larger=("RepositoryModelLoad",))
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, self.health, self._server,
                     _service(health_pb2, "Health"), bounds, most_bytes=most_bytes)
        add_servicer(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.aio.ReflectionServicer(  # type: ignore[attr-defined]  # as health.aio
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)), self._server,
            _service(reflection_pb2, "ServerReflection"), bounds, most_bytes=most_bytes)
        address = host_port(network.host, network.port)
        try:
            self.port = (self._server.add_secure_port(address, self.credentials) if self.credentials
                         else self._server.add_insecure_port(address))
        except RuntimeError:  # gRPC says only "Failed to bind" (and logs the reason)
            raise StartupError(f"cannot listen on {address}: the port is in use, or the address is not "
                               "this machine's") from None
        await self._server.start()
        if network.http_port:
            self.http = HttpListener(self._http_api(bounds), network, config.frontends > 1, self.tokens,
                                     config.grace_period)
            await self.http.start()
        self._start_tracing(host_port(network.host, self.port))
        return self.port

    def _http_api(self, bounds: WireBounds) -> HttpApi:
        config = self.config
        most_body = config.network.max_message_mb << 20
        # A file of weights travels in base64 over HTTP: a third larger.
        most_load = (config.max_weights_mb + 1 << 20) * 4 // 3 if config.model_control == "explicit" else most_body
        return HttpApi(self.inference, self.classifier, self.ready, bounds, config.max_images_per_request,
                       most_body, max(most_load, most_body))

    def ready(self) -> bool:
        """Whether this front-end takes calls, as its gRPC health says: loaded, a replica in rotation, not
        draining."""
        return self.inference.ready() and not self._draining and not self._no_replica

    async def load(self) -> None:
        """Connect to every engine and wait until each has warmed up, then report SERVING (once a replica is
        in rotation: a replacement front-end may find every engine's device out of it)."""
        config = self.config
        self.control.listen()
        replicas = await self._connect_engines()
        served = self.control.served
        if not served.sha256:  # the weights every engine started with: the first one's say what they are
            self.control.served = dataclasses.replace(served, source=served.source or replicas[0].weights.source,
                                                      sha256=replicas[0].info.weights_sha256)
        self.control.connected_source = self.control.served.source
        limits = Limits(config.max_images_per_request, config.max_pixels)
        self.core = Dispatcher(Router(replicas), self.metrics, limits, self.temperature,
                                  config.preprocess_threads, self._no_replica_left,
                                  callers_by(resolved_mode(config.fair_share, bool(self.tokens)), self.token_entries))
        info = model_info(config, replicas, self.temperature, self.temperature_source)
        self._record_model_info(replicas)
        self.classifier.attach(self.core, info)
        self.inference.attach(self.core, LABELS, info)
        self._suggest_bf16(replicas)
        self.core.unloaded = None if self.control.served.loaded else UNLOADED
        if self.core.router.any_healthy() and self.core.unloaded is None:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        elif self.core.unloaded is None:  # every engine answered, none with its device in rotation: SERVING when one
            self._no_replica_left()  # rejoins
        else:  # unloaded: live, not ready
            await self._set_health(health_pb2.HealthCheckResponse.SERVING, ("",))
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, SERVICE_NAMES)

    def _weights_changed(self, served: ServedWeights) -> None:
        """The supervisor says which weights every engine serves now: after an unload, the services' health says
        NOT_SERVING (readiness) and calls are refused until the next load; the server's own ("", liveness)
        stays SERVING, as the process is well and a restart would undo the unload."""
        if self.core is None:
            return
        for replica in self.core.router.replicas:  # resnet_model_info names what every engine serves now
            self._model_info_series(replica.name, self.control.weights_shown(replica.weights.source))
        self.core.unloaded = None if served.loaded else UNLOADED
        if not served.loaded:
            self._change_health(health_pb2.HealthCheckResponse.NOT_SERVING, SERVICE_NAMES)
        elif self.core.router.any_healthy() and not self._draining:
            self._change_health(health_pb2.HealthCheckResponse.SERVING)

    async def _connect_engines(self) -> list[EngineClient]:
        clients = [EngineClient(link, self.owner, self._engine_lost, self._replica_rejoined) for link in self.links]
        await asyncio.gather(*(client.open() for client in clients))
        return clients

    def _engine_lost(self) -> None:
        if self.core is not None and not self.core.router.any_healthy():
            self._no_replica_left()

    def _suggest_bf16(self, replicas: Sequence[EngineHandle]) -> None:
        """One line per process (not per replica) where fp32 runs on a CPU that computes bf16 much faster."""
        if self.config.precision == "fp32" and any(replica.device == "cpu" for replica in replicas) \
                and (unit := cpu_bf16_unit()):
            log.info("this CPU has %s here, with logits within about 0.5%% of fp32's range "
                     "(docs/performance.md, bf16 on the CPU)",
                     unit)

    def _record_model_info(self, replicas: Sequence[EngineHandle]) -> None:
        for replica in replicas:
            self._model_info_series(replica.name, replica.weights.source)

    def _model_info_series(self, device: str, weights: str) -> None:
        self.metrics.model.labels(device).info(
            {"model": MODEL_NAME, "version": MODEL_VERSION, "weights": weights, "server_version": __version__,
             "runtime": self.config.runtime})

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        """Ask serve() to drain and end the process with ``exit_code``; the first request wins."""
        if not self.stop_requested.is_set():
            self.stop_reason, self.exit_code = reason, exit_code
            self.stop_requested.set()

    def _no_replica_left(self) -> None:
        """Every replica is out of rotation: health says NOT_SERVING, so that balancers stop sending work
        here. A front-end run alone drains and exits 1 unless a replica's probe brings one back within
        --unhealthy-exit-after seconds: its orchestrator then replaces it, and a fresh process is what clears a
        CUDA context that a fault has left unusable. A supervised front-end stays: the engine ends itself after
        the same time and the supervisor replaces it, while this process keeps the port and answers health."""
        if self._no_replica:
            return
        log.error("no healthy replica is left; health now reports NOT_SERVING")
        self._no_replica = True
        self._change_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if (seconds := self.config.unhealthy_exit_after) and not self.control.supervised:
            self._give_up = asyncio.get_running_loop().call_later(
                seconds, self.request_stop, f"no replica back in rotation within {seconds:g}s "
                "(--unhealthy-exit-after)", 1)

    @property
    def engines(self) -> Sequence[EngineHandle]:
        """The engines this front-end serves from, once loaded (what each reported: its ``info``)."""
        return self.core.router.replicas if self.core is not None else ()

    @property
    def gives_up_at(self) -> float | None:
        """The event loop's time at which this process drains and exits for want of a replica in rotation
        (--unhealthy-exit-after), or None while none is due."""
        return None if self._give_up is None else self._give_up.when()

    def _replica_rejoined(self) -> None:
        """A replica is back in rotation: if health had gone NOT_SERVING for want of one, it is SERVING again."""
        if self._no_replica and not self._draining:
            log.warning("a replica is back in rotation; health reports SERVING again")
            self._no_replica = False
            self._cancel_give_up()
            if self.core is None or self.core.unloaded is None:
                self._change_health(health_pb2.HealthCheckResponse.SERVING)

    def _cancel_give_up(self) -> None:
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None

    def _change_health(self, status: int, names: Sequence[str] = ("", *SERVICE_NAMES)) -> None:
        """From a synchronous callback on the loop; each change waits for the one before, so the last wins."""
        self._health_update = asyncio.ensure_future(self._set_health_after(self._health_update, status, names))

    async def _set_health_after(self, previous: asyncio.Future | None, status: int, names: Sequence[str]) -> None:
        if previous is not None:
            await previous
        await self._set_health(status, names)

    async def _set_health(self, status: int, names: Sequence[str] = ("", *SERVICE_NAMES)) -> None:
        for name in names:
            await self.health.set(name, status)

    async def begin_drain(self) -> None:
        """Health says NOT_SERVING so balancers and orchestrators stop sending new work."""
        self._draining = True
        self._change_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # after any change still under way
        if self._health_update is not None:
            await self._health_update

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, answer accepted ones within grace, then let the replicas go."""
        grace = self.config.grace_period if grace is None else grace
        self._cancel_give_up()
        await self.begin_drain()
        stopping = [self._server.stop(grace)] if self._server is not None else []
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        if self.core is not None:
            self.core.router.stop(timeout=grace)
            self.core.close()
        self.shared_memory.close()  # every call has ended: no region is in use
        if self.tracing is not None:  # the spans still queued go out, for as long as a receiver down allows
            await _within(self.tracing.shutdown, TRACING_FLUSH_SECONDS)

    def _start_tracing(self, address: str) -> None:
        """With an OTLP endpoint: spans of every call, and their ids in the log lines about it."""
        self.tracing = tracing = Tracing.start(self.config.otlp_endpoint, self.config.trace_rate, address)
        if tracing is not None:
            log_trace_ids()
            self.classifier.tracing = self.inference.tracing = tracing
            tracing.sampler.update(self.control.trace_settings)  # as set while serving, before this process
            self.control.on_trace(tracing.sampler.update)


class _Handlers:
    """Stands in for a server to keep the method handlers a generated ``add_*_to_server`` registers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add_to_server: Callable, servicer: object, server: grpc.aio.Server,
                 service: ServiceDescriptor, bounds: WireBounds,
                 deserializers: dict[str, Callable[[bytes], object]] | None = None,
                 rare: dict[str, Callable[[bytes], object]] | None = None,
                 most_bytes: int | None = None, larger: Sequence[str] = ()) -> None:
    """``add_to_server(servicer, server)`` (the generated one), every method's requests checked against
    ``bounds`` before they are read (resnet_server.frontend.handlers) and against ``most_bytes`` (but those named in
    ``larger``, for which gRPC's own limit is raised), with the methods of ``deserializers`` (those that
    carry pixels) registered with gRPC and their requests read by it instead of protobuf's parse; the others only
    in a generic handler, ``rare`` ones read by the reader given. gRPC's server loop waits on one future per
    registered method for every call it takes, so a registered method nobody calls costs every call."""
    deserializers = deserializers or {}
    readers = {**(rare or {}), **deserializers}
    generated = _Handlers()
    add_to_server(servicer, generated)
    handlers = {name: registered(handler._replace(request_deserializer=readers[name]) if name in readers else handler,
                                 service.methods_by_name[name].input_type, bounds,
                                 None if name in larger else most_bytes)
                for name, handler in generated.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(generated.service, handlers),))
    # grpcio 1.62's API, newer than grpc-stubs.
    with_readers = {name: handlers[name] for name in deserializers}
    server.add_registered_method_handlers(generated.service, with_readers)  # type: ignore[attr-defined]


async def _within(work: Callable[[], object], seconds: float) -> None:
    """``work()`` on a thread of its own, waited for at most ``seconds``: a daemon thread, not the default
    executor's, which the loop's close would wait for however long the work takes (the SDK's shutdown retries
    an export for up to half a minute)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            work()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed: no one waits any more
                loop.call_soon_threadsafe(_settle, done)

    threading.Thread(target=run, name="tracing-shutdown", daemon=True).start()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(done, seconds)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _service(module: ModuleType, name: str) -> ServiceDescriptor:
    """A service's descriptor, from the module protoc made for its file."""
    return module.DESCRIPTOR.services_by_name[name]


def _connection_age_options(config: FrontendConfig) -> list[tuple[str, int]]:
    """GOAWAY after --max-connection-age (gRPC adds +-10% jitter, so clients do not reconnect in step), calls in
    flight then having --grace-period to finish. A client's connection otherwise stays on the process (or, with
    several front-ends, the front-end) it first reached, however many have been added since."""
    if not config.network.max_connection_age:
        return []
    return [("grpc.max_connection_age_ms", round(config.network.max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", round(config.grace_period * 1000))]


def model_info(config: FrontendConfig, replicas: Sequence[EngineHandle], temperature: float, source: str
               ) -> pb.ModelInfo:
    weights = replicas[0].weights
    return pb.ModelInfo(
        name=MODEL_NAME,
        version=MODEL_VERSION,
        labels=LABELS,
        input=pb.InputSpec(encodings=list(ENCODINGS), raw_formats=list(RAW_FORMATS), max_pixels=config.max_pixels,
                           max_images_per_request=config.max_images_per_request, crop_size=CROP,
                           resize_size=RESIZE, mean=MEAN, std=STD),
        devices=[replica.name for replica in replicas],
        default_temperature=temperature,
        temperature_source=source,
        batching=pb.BatchingSpec(max_batch_size=max(replica.max_batch_size for replica in replicas),
                                 max_batch_delay_ms=config.max_batch_delay_ms, max_queue=config.max_queue,
                                 wait_for_callers_ms=config.wait_for_callers_ms),
        weights=weights.source,
        warning=weights.warning,
        precision=config.precision,
        runtime=config.runtime,
        runs=[replica.runs for replica in replicas],
    )


async def serve(config: FrontendConfig, index: int, engines: Sequence[EngineLink], owner: int, metrics: Metrics,
                on_bound: OnBound | None = None, on_serving: Callable[[], object] | None = None,
                load_first: bool = False, control: SupervisorClient | None = None) -> int:
    """Run until SIGTERM or SIGINT (exit code 0), or until no replica has been in rotation for
    --unhealthy-exit-after seconds (1), then drain within the grace period. ``on_bound`` and ``load_first``: see
    FrontendServer.start; ``on_serving`` hears when health says SERVING; ``metrics``: a front-end's (see
    FrontendServer)."""
    use_torch_threads(1)  # the event loop computes nothing: no OpenMP team to slow the replicas' (common.threads)
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    app = FrontendServer(config, metrics, engines, owner, index, control)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.request_stop, f"{sig.name} received")
    try:
        started = await _unless_stopped(app.start(on_bound, load_first), app.stop_requested)
    except BaseException:
        await app.stop(0)  # close the bound port before the error ends the process
        raise
    if not started:  # a signal while loading (a front-end waits for its engines' warm-up): nothing was accepted
        await app.stop(0)
        log.info("%s before serving: stopped", app.stop_reason)
        return app.exit_code
    if on_serving is not None:
        on_serving()  # before the log line: once that is out, a supervisor knows this front-end has served
    app.log_serving()
    await app.stop_requested.wait()
    log.log(logging.ERROR if app.exit_code else logging.INFO, "%s: draining for up to %.1fs", app.stop_reason,
            config.grace_period)
    await app.stop()
    log.info("stopped")
    return app.exit_code


async def _unless_stopped(work: Awaitable[object], stop: asyncio.Event) -> bool:
    """Await ``work`` unless ``stop`` is set first, which cancels it: whether it finished (its error raised)."""
    task, stopping = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


def run(config: FrontendConfig, index: int, engines: Sequence[EngineLink], owner: int, metrics: Metrics,
        on_bound: OnBound | None = None, on_serving: Callable[[], object] | None = None,
        load_first: bool = False, control: SupervisorClient | None = None) -> int:
    """Serve until stopped and drain; serve()'s exit code, or exit 1 at once with the error in one line if
    start-up fails."""
    try:
        return event_loop.run(serve(config, index, engines, owner, metrics, on_bound, on_serving, load_first,
                                    control), config.event_loop)
    except StartupError as exc:
        worker = f"front-end {index}: " if config.frontends > 1 else ""
        print(f"resnet-server: error: {worker}{exc}", file=sys.stderr)
        exit_at_once(1)

