"""Shared test helpers: engine processes with front-ends on their own event loops, images, and a torchvision
reference."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import importlib.util
import io
import os
import random
import shutil
import socket
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from torchvision.io import ImageReadMode, decode_image
from torchvision.models import resnet18
from torchvision.transforms import v2

from resnet_client import ClassifierError, Client
from resnet_server.common.config import ServerConfig, host_port
from resnet_server.common.event_loop import new_event_loop
from resnet_server.common.metrics import Metrics, serve_child_metrics
from resnet_server.common.sections import frontend_config
from resnet_server.common.statistics import SharedRow
from resnet_server.frontend.server import FrontendServer
from resnet_server.supervisor.merged_metrics import serve_merged_metrics

TEST_SEED = 1234
ROOT = Path(__file__).resolve().parent.parent
IN_CI = bool(os.environ.get("CI"))  # where CI runs, a missing tool fails its tests instead of skipping them
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None and not IN_CI,
                                    reason="promtool/prometheus (Debian package prometheus) not installed")


def load_script(name: str):
    """A module from scripts/ or scripts/benchmarks/, which are not packages."""
    path = ROOT / "scripts" / f"{name}.py"
    if not path.exists():
        path = ROOT / "scripts" / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look a module's classes up
    spec.loader.exec_module(module)
    return module


# Triton's perf_analyzer (the tritonclient 2.41 wheel's binary, found as scripts/perf_analyzer.py finds it)
# links libb64 (Debian's libb64-0d) and libcudart.so.12 (the nvidia-cuda-runtime-cu12 wheel of the test extra).
needs_perf_analyzer = pytest.mark.skipif(
    (load_script("perf_analyzer").binary() is None or ctypes.util.find_library("b64") is None) and not IN_CI,
    reason="perf_analyzer (tritonclient 2.41 wheel) or libb64 (Debian libb64-0d) not installed")


def base_config(weights: str, **overrides) -> ServerConfig:
    config = ServerConfig(host="127.0.0.1", port=0, http_port=0, metrics_port=0, devices=("cpu",), weights=weights,
                          max_batch_size=8, preprocess_threads=2, grace_period=5.0)
    return replace(config, **overrides)


class ServerThread:
    """A front-end (a FrontendServer) of the engine processes ``engines``, as owner ``owner`` in their slabs, on its own
    asyncio loop in a daemon thread: tests talk to it over real gRPC and read its series. Where its engines serve
    their own /metrics (``engine_metrics_ports``), it serves its own too on a loopback port, as a front-end process
    does for the supervisor; ``metrics_port`` is then the server's merged /metrics (EngineSet)."""

    def __init__(self, config: ServerConfig, engines, owner: int, engine_metrics_ports=(),
                 statistics: SharedRow | None = None) -> None:
        self.metrics = Metrics(config.largest_batch, statistics)  # its row of the server's statistics
        self.app = FrontendServer(frontend_config(config, config.port, config.frontends or 1), self.metrics, engines,
                                  owner)
        self.engine_metrics_ports = list(engine_metrics_ports)
        self.metrics_http = serve_child_metrics(self.metrics.registry) if self.engine_metrics_ports else None
        self.metrics_port = 0
        self.host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(config.host, config.host)  # where to call it
        self.loop = new_event_loop(config.event_loop)  # uvloop where installed, as the server's own processes run
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float = 120.0):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self.run(self.app.start())
        return self

    @property
    def target(self) -> str:
        return host_port(self.host, self.app.port)

    @property
    def http_target(self) -> str:
        """Its HTTP port's ``host:port`` (a server started with an ``http_port``)."""
        assert self.app.http is not None, "started without http_port"
        return host_port(self.host, self.app.http.port)

    def sample(self, name: str, **labels) -> float:
        """The server's value of one series, summed over the labels not given (a request's ``protocol``, say):
        this front-end's, plus its engines' (read from their /metrics)."""
        value = sum(sample.value for family in self.metrics.registry.collect() for sample in family.samples
                    if sample.name == name and labels.items() <= sample.labels.items())
        return value + sum(engine_sample(port, name, labels) for port in self.engine_metrics_ports)

    def stop(self, grace: float = 5.0) -> None:
        if not self._thread.is_alive():  # stopped already (by the test)
            return
        self.run(self.app.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()


FRONTEND_ROWS = 6  # front-ends an EngineSet has statistics rows for: processes from row 0, threads from the last


class EngineSet:
    """The engine processes of ``config`` (one per device), started and stopped as the server's supervisor does,
    with front-ends run here (``frontend``: a ServerThread) or as processes of their own (``start_frontend``),
    and with a ``--metrics-port`` the merged /metrics of them all, as resnet-server serves it. The test holds the
    slabs too, so it can see which slots are taken."""

    def __init__(self, config: ServerConfig) -> None:
        from resnet_server.common.devices import resolve_devices
        from resnet_server.supervisor.launcher import Supervisor

        self.config = config
        # Statistics rows (and owner numbers, below) for front-ends run here beside any the supervisor starts.
        self.supervisor = Supervisor(replace(config, frontends=FRONTEND_ROWS), resolve_devices(config.devices))
        self._owners = iter(range(1000, 2000))  # in-process front-ends' numbers, apart from the supervisor's
        self._frontends: list[ServerThread] = []
        self.metrics_http = None
        try:
            assert self.supervisor.start_engines() is None, f"an engine ended before it was ready: {self.failure}"
            self.metrics_http = serve_merged_metrics(config.metrics_host, config.metrics_port, self.metric_endpoints)
        except BaseException:
            self.stop()
            raise

    @property
    def failure(self) -> str:
        return self.supervisor.failure

    def metric_endpoints(self) -> list[tuple[str, int]]:
        """The supervisor's children's, then the front-ends run here, labelled after them."""
        children = [(worker, port) for worker, port in self.supervisor.metric_endpoints()
                    if port or worker.startswith("engine-")]
        here = [(str(len(children) - len(self.links) + index), running.metrics_http.server_port)
                for index, running in enumerate(self._frontends)]
        return [*here, *children]

    @property
    def links(self):
        return self.supervisor.links

    def engine_pid(self, index: int = 0) -> int:
        return self.supervisor.children[f"engine-{index}"].process.pid

    def engine_metrics_port(self, index: int = 0) -> int:
        """Where engine ``index`` serves its own /metrics (a loopback port it reported when it started)."""
        return self.supervisor.children[f"engine-{index}"].metrics_port

    def frontend(self, start: bool = True, **overrides) -> ServerThread:
        """A front-end of these engines run here: started (bound and connected to them, SERVING), or, with
        ``start`` False, for the test to bind and load."""
        config = replace(self.config, **{"metrics_port": 0, **overrides})  # the engines have the ports
        ports = [self.engine_metrics_port(index) for index in range(len(self.links))] if self.config.metrics_port \
            else []
        row = SharedRow(self.supervisor.statistics, FRONTEND_ROWS - 1 - len(self._frontends))
        running = ServerThread(config, self.links, next(self._owners), ports, row)
        running.metrics_port = self.config.metrics_port
        self._frontends.append(running)
        return running.start() if start else running

    def start_frontend(self, index: int) -> int:
        """Front-end process ``index`` on a port of its own; once it serves, that port."""
        child = self.supervisor.start_frontend(index, 0)
        assert self.supervisor.wait_until(lambda: child.serving) is None, "the front-end ended before serving"
        return child.port

    def restart_engine(self, index: int = 0) -> None:
        """What the supervisor does when an engine has ended: start a new one and wait until it is warm."""
        assert self.supervisor.replace_engine(index) is None

    def taken_slots(self, index: int = 0) -> int:
        from resnet_server.boundary.slab import Slab

        link = self.links[index]
        slab = Slab(link.slab_fd, link.layout)
        try:
            return int((slab.owners != 0).sum())
        finally:
            slab.close()

    def stop(self) -> None:
        for running in self._frontends:
            running.stop(grace=1.0)
        self.supervisor.stop()
        self.supervisor.close()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()


def engine_sample(port: int, name: str, labels: dict[str, str]) -> float:
    """One sample's value on an engine's own /metrics (0 when it has none)."""
    for family in text_string_to_metric_families(scrape(port)):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def save_random_weights(path, seed: int = TEST_SEED) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    state = resnet18(weights=None).state_dict()
    torch.save(state, path)
    return state


def random_rgb(seed: int, height: int = 240, width: int = 320) -> np.ndarray:
    """A smooth-ish random picture (uint8 HxWx3), so JPEG keeps it recognisable."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    big = np.kron(small, np.ones((8, 8, 1), dtype=np.uint8))[:height, :width]
    noise = rng.integers(0, 32, size=big.shape, dtype=np.uint8)
    return (big // 2 + noise).astype(np.uint8)


def encode(array: np.ndarray, fmt: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


class Reference:
    """The expected answer, computed directly with torchvision (same transform, weights and T).

    The transform is torchvision's documented ImageNet eval pipeline for ResNet18 spelled out in
    ``transforms.v2`` (tests/test_preprocess.py holds it to the v1 preset, and the server's fused version to it)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model = resnet18(weights=None)
        self.model.load_state_dict(state_dict)
        self.model.eval()
        self.transform = v2.Compose([
            v2.Resize(256, interpolation=v2.InterpolationMode.BILINEAR, antialias=True),
            v2.CenterCrop(224),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    @torch.inference_mode()
    def logits(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch)

    def input_from_bytes(self, data: bytes) -> torch.Tensor:
        decoded = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        return self.transform(decoded)

    def input_from_array(self, array: np.ndarray) -> torch.Tensor:
        return self.transform(torch.from_numpy(array).permute(2, 0, 1))

    def probabilities(self, model_input: torch.Tensor, temperature: float = 1.0) -> np.ndarray:
        logits = self.logits(model_input.unsqueeze(0))[0]
        return torch.softmax(logits / temperature, dim=0).numpy()


_HANDED_OUT: set[int] = set()  # the ports free_port has given in this run


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports it picks for port 0 and outgoing connections."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low, high = ephemeral.read_text().split() if ephemeral.exists() else (32768, 60999)  # Linux's default elsewhere
    return int(low), int(high)


def listening_ports(pids: list[int]) -> set[tuple[str, int]]:
    """The IPv4 TCP (address, port) pairs that the processes ``pids`` listen on (Linux's /proc)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if (target := os.readlink(fd)).startswith("socket:["):
                    inodes.add(target[8:-1])
    listening = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
            address, port = fields[1].split(":")
            listening.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return listening


def free_port() -> int:
    """A free port for a server a test starts later (a port 0 server needs none), taken below the kernel's
    ephemeral range: a port in that range, free when checked, may become an outgoing connection's own port
    before the server binds it (seen once in CI, 'Address already in use')."""
    low = ephemeral_ports()[0]
    for _ in range(200):
        port = random.randrange(10_000, low)
        if port not in _HANDED_OUT and _bindable(port):
            _HANDED_OUT.add(port)  # two picks in one test before either binds must differ
            return port
    raise RuntimeError(f"no free port found below {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def scraped_value(port: int, sample: str) -> float:
    """One sample's value from a server's /metrics, e.g. 'resnet_queue_depth{device="cpu"}'; 0 if absent."""
    for line in scrape(port).splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Wait until a condition observed from outside (a metric, a health status) holds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def serving(client: Client) -> bool:
    """Whether the server answers health with SERVING; False while it is not listening yet."""
    try:
        return client.health() == "SERVING"
    except ClassifierError:
        return False


class Faults:
    """The fault file of a server started with ``--runner faulty:FILE`` (resnet_server.engine.runners): what its
    batches do from the next one on, for every replica or for one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    @property
    def runner(self) -> str:
        return f"faulty:{self.path}"

    def set(self, fault: str, replica: str | None = None) -> None:
        self.path.write_text(f"@{replica} {fault}\n" if replica else f"{fault}\n")

    def clear(self) -> None:
        self.path.write_text("")


DEVICE_FELL_OFF = "fail device fell off the bus"


def break_until_evicted(running: ServerThread, faults: Faults, replica: str = "cpu") -> None:
    """Make the replica's batches fail and send requests until the router has taken it out."""
    faults.set(DEVICE_FELL_OFF, replica)
    image = encode(random_rgb(5))
    with Client(running.target) as client:
        while running.sample("resnet_replica_healthy", device=replica) == 1:
            try:
                client.classify([image])
            except ClassifierError as exc:
                assert exc.code == grpc.StatusCode.INTERNAL


def method_name(call_details) -> str:
    """A client interceptor's call details' method as text (grpc.aio's hold bytes, grpc's a str)."""
    method = call_details.method
    return method.decode() if isinstance(method, bytes) else method


class _AsyncUnarySeen(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, methods: list[str]) -> None:
        self.methods = methods

    async def intercept_unary_unary(self, continuation, call_details, request):
        self.methods.append(method_name(call_details))
        return await continuation(call_details, request)


class _AsyncStreamSeen(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, methods: list[str]) -> None:
        self.methods = methods

    async def intercept_stream_stream(self, continuation, call_details, request_iterator):
        self.methods.append(method_name(call_details))
        return await continuation(call_details, request_iterator)


def async_methods_seen() -> tuple[list[str], list]:
    """grpc.aio client interceptors that note every call's method in one list and let the call through: one of
    each kind, since a grpc.aio channel files an interceptor under the first kind it is."""
    methods: list[str] = []
    return methods, [_AsyncUnarySeen(methods), _AsyncStreamSeen(methods)]


class HealthProbe:
    """Health checks on the front-end, one after another on a thread, each timed."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe)
        self._thread.start()

    def _probe(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            self.times.append(time.monotonic() - started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


def small_onnx_model(path: Path) -> Path:
    """An ONNX model of ResNet18's input (float [N, 3, 224, 224]) that costs little to run: a strided convolution,
    [N, 3136] out."""
    torch.onnx.export(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 7, stride=8), torch.nn.Flatten()),
                      (torch.zeros(1, 3, 224, 224),), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "n"}})
    return path
