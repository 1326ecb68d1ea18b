"""One model replica per listed device, each with its own batcher and worker thread.

Independent replicas (rather than ``nn.DataParallel``) let every device run its own batches
concurrently, with no scatter/gather through one GPU on each forward pass.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from resnet_server.common import onnx_file
from resnet_server.common.config import DEFAULT_MAX_BATCH_SIZE
from resnet_server.common.errors import StartupError
from resnet_server.common.metrics import Metrics
from resnet_server.common.model import LoadedWeights, WeightsError, build_model, file_sha256, load_weights
from resnet_server.common.sections import EngineConfig
from resnet_server.common.threads import use_torch_threads
from resnet_server.engine import inductor, onnx_runtime
from resnet_server.engine.batcher import Answers, Batcher
from resnet_server.engine.runner import ModelRunner, bucket_sizes
from resnet_server.engine.runners import build_runner

log = logging.getLogger(__name__)

# A replica whose batches fail this many times in a row leaves the rotation.
FAILURES_BEFORE_EVICTION = 3

def max_batch_size(config: EngineConfig, device: torch.device) -> int:
    """--max-batch-size, or the device's default; a default over --max-queue is the queue (no batch could fill
    it, and warming sizes past it would only slow the start)."""
    if config.max_batch_size:
        return config.max_batch_size
    return min(DEFAULT_MAX_BATCH_SIZE.get(device.type, DEFAULT_MAX_BATCH_SIZE["cpu"]), config.max_queue)


# How long a swap may wait for the batch in progress (a CPU batch takes up to seconds; a GPU's milliseconds).
SWAP_SECONDS = 60.0


@dataclass
class _Staged:
    """New weights made ready beside the served ones, and what puts them in place."""

    weights: LoadedWeights
    runner: ModelRunner
    put_in_place: Callable[[], None]


@dataclass
class Replica:
    name: str
    device: torch.device
    runner: ModelRunner
    batcher: Batcher
    weights: LoadedWeights
    decode_on_device: bool = False  # JPEGs go to the batcher undecoded, decoded there in one batch
    torch_threads: int = 1  # the OpenMP team of its worker thread (replica_torch_threads)
    setup: _ReplicaSetup | None = None  # how its runner was built: a compiled one is built again for new weights
    staged: _Staged | None = None

    @property
    def healthy(self) -> bool:
        return self.batcher.in_rotation

    def stage(self, source: str) -> LoadedWeights:
        """Load ``source`` and make it ready beside the weights served now, which serve on meanwhile: copied into
        the served precision and layout (eager, CUDA graphs), or a new runner compiled and warmed up (inductor's
        cache makes that fast), or an ONNX file's session. WeightsError if the weights are not a ResNet18's."""
        if self.setup is not None and self.setup.serves_files:
            runner, weights = self.setup.file_runner(source)
            self.staged = _Staged(weights, runner, lambda: self.batcher.use_runner(runner))
            return weights
        loaded = load_weights(source, self.device)
        model = build_model(loaded, self.device)
        weights = loaded.without_tensors()
        del loaded  # the model holds them now: one copy less while the reload is under way
        if self.runner.swaps_in_place:
            tensors = self.runner.staged(model)
            runner = self.runner
            self.staged = _Staged(weights, runner, lambda: runner.load_staged(tensors))
        else:
            if self.setup is None:
                raise RuntimeError(f"replica {self.name} cannot build a new runner")
            runner = self.setup.warmed(model)
            self.staged = _Staged(weights, runner, lambda: self.batcher.use_runner(runner))
        return weights

    def commit(self, version: int) -> None:
        """Put the staged weights in place between two batches: every later batch runs as ``version``."""
        staged, self.staged = self.staged, None
        if staged is None:
            raise RuntimeError(f"replica {self.name} has no weights staged")
        self.batcher.swap(staged.put_in_place, version, SWAP_SECONDS)
        self.weights, self.runner = staged.weights, staged.runner


class _ReplicaSetup:
    """Runs on the replica's worker thread: load weights, build, place and warm up the model."""

    def __init__(self, name: str, device: torch.device, config: EngineConfig, batch_limit: int) -> None:
        self.name = name
        self.device = device
        self.config = config
        self.batch_limit = batch_limit
        self.torch_threads = replica_torch_threads(config, device)
        self.weights: LoadedWeights | None = None
        self.runner: ModelRunner | None = None

    @property
    def serves_files(self) -> bool:
        """Whether the weights are an ONNX file, served as it is (a quantized model), not a state_dict."""
        return self.config.weights.endswith(".onnx")

    def __call__(self) -> ModelRunner:
        config, device = self.config, self.device
        if config.runtime == "onnxruntime" and device.type != "cpu":
            raise StartupError(f"--runtime onnxruntime runs on the CPU, not on {device}")
        # This thread's OpenMP team: set here, since other threads (preprocessing) set theirs to 1. ONNX Runtime
        # computes the forward pass on a thread pool of its own (torch_threads wide): a torch team beside it
        # would spin on the same cores after each of the batch's small torch operations.
        use_torch_threads(1 if config.runtime == "onnxruntime" else self.torch_threads)
        if self.serves_files:
            self.runner, self.weights = self.file_runner(config.weights)
            return self.runner
        loaded = load_weights(config.weights, device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = config.cudnn_benchmark
        model = build_model(loaded, device)
        self.weights = loaded.without_tensors()
        del loaded
        self.runner = self.warmed(model)
        return self.runner

    def warmed(self, model: torch.nn.Module) -> ModelRunner:
        """A runner of ``model`` as the flags say, warmed up at every bucket."""
        config, device = self.config, self.device
        if config.compile and device.type == "cpu":  # the worker's team, not that of the thread compiling
            inductor.pin_cpu_threads(self.torch_threads)
        runner = build_runner(config.runner, self.name, model, device, config.precision, config.channels_last,
                              compiled=config.compile, compile_mode=config.compile_mode,
                              compile_cache=config.compile_cache, torchscript=config.torchscript,
                              cuda_graphs=config.uses_cuda_graphs, runtime=config.runtime,
                              threads=self.torch_threads, onnx_provider=config.onnx_provider)
        sizes = bucket_sizes(self.batch_limit, device.type == "cuda")
        try:
            runner.warm_up(sizes)
        except Exception as exc:
            # A setup problem, named by its flag: no C++ compiler for CPU kernels or an unsupported GPU (--compile),
            # an operation CUDA cannot capture or the memory the graphs need (--cuda-graphs).
            if config.compile:
                flag, hint = "--compile", "inductor needs a C++ compiler for CPU devices; or run without --compile"
            elif runner.cuda_graphs:
                flag, hint = "--cuda-graphs", "or run with --cuda-graphs false"
            else:
                raise
            raise StartupError(f"{flag} failed on {device}: {type(exc).__name__}: {str(exc)[:300]} ({hint})") from exc
        return runner

    def file_runner(self, source: str) -> tuple[ModelRunner, LoadedWeights]:
        """A runner of the ONNX model at ``source``, warmed up, and what it is; WeightsError if the file is no
        model of the precision served."""
        path = Path(source)
        try:
            network = onnx_runtime.OnnxNetwork(path, self.torch_threads, self.config.onnx_provider)
        except Exception as exc:  # onnxruntime's own errors: a missing, truncated or foreign file
            raise WeightsError(f"weights {source}: not an ONNX model ONNX Runtime can load "
                               f"({type(exc).__name__})") from exc
        if (problem := network.unlike_resnet18()) is not None:
            raise WeightsError(f"weights {source}: not a ResNet18 model: {problem}")
        recorded = network.recorded()
        if (problem := onnx_file.unlike_served(recorded, self.config.precision)) is not None:
            raise WeightsError(f"weights {source}: {problem}")
        runner = ModelRunner(None, self.device, self.config.precision, runtime="onnxruntime",
                             threads=self.torch_threads, network=network)
        runner.warm_up(bucket_sizes(self.batch_limit, False))
        sha256 = file_sha256(path)
        made = f"; quantized from weights of SHA-256 {onnx_file.recorded_text(recorded, onnx_file.SOURCE_SHA256)}, " \
            f"calibrated on images of SHA-256 {onnx_file.recorded_text(recorded, onnx_file.CALIBRATION_SHA256)}" \
            if onnx_file.SOURCE_SHA256 in recorded else ""
        log.info("replica %s serves the ONNX model %s (SHA-256 %s)%s", self.name, source, sha256, made)
        return runner, LoadedWeights({}, source, sha256=sha256)

    def loaded(self) -> tuple[ModelRunner, LoadedWeights]:
        """What the worker's thread set up, once the batcher has started, handed over once: the setup keeps no
        runner (a reload's new one would otherwise leave the first, its graphs and memory, alive beside it)."""
        runner, weights, self.runner, self.weights = self.runner, self.weights, None, None
        if runner is None or weights is None:
            raise RuntimeError(f"replica {self.name} has not been set up")
        return runner, weights


def load_replica(name: str, device: torch.device, config: EngineConfig, metrics: Metrics,
                 on_rejoin: Callable[[], None], answers: Answers) -> Replica:
    """Start the replica's worker thread, which loads and warms the model before taking work.
    ``on_rejoin`` is called on that thread whenever the replica comes back into rotation; ``answers``: where
    the batches' answers go (see Batcher)."""
    started = time.monotonic()
    batch_limit = max_batch_size(config, device)
    setup = _ReplicaSetup(name, device, config, batch_limit)
    batcher = Batcher(name, setup, metrics, max_batch_size=batch_limit,
                      max_batch_delay_ms=config.max_batch_delay_ms,
                      failures_before_eviction=FAILURES_BEFORE_EVICTION,
                      probe_interval=config.replica_probe_interval, on_rejoin=on_rejoin,
                      answers=answers, wait_for_callers_ms=config.wait_for_callers_ms)
    try:
        batcher.start()
    except StartupError:
        raise
    except Exception as exc:  # a failure with no message of ours (out of memory in warm-up, a bad device...)
        log.exception("replica %s failed to start on %s", name, device)
        raise StartupError(f"replica {name} failed to start on {device}: {type(exc).__name__}: {str(exc)[:300]}"
                           ) from exc
    runner, weights = setup.loaded()
    elapsed = time.monotonic() - started
    metrics.load_time.labels(name).set(elapsed)
    metrics.healthy.labels(name).set_function(lambda: 1 if batcher.in_rotation else 0)
    if device.type == "cuda":
        _watch_gpu(name, device, runner, metrics)
    log.info("replica %s ready on %s in %.2fs (weights %s); %s", name, device, elapsed, weights.source,
             runner.describe())
    if weights.warning:
        log.warning("%s", weights.warning)
    decode_on_device = config.decode_on_device == "true" or (
        config.decode_on_device == "auto" and device.type == "cuda")
    batcher.weights_version = config.weights_version
    return Replica(name, device, runner, batcher, weights, decode_on_device, setup.torch_threads, setup)


def replica_torch_threads(config: EngineConfig, device: torch.device) -> int:
    """--torch-threads, or by default every core for a CPU replica (its forward pass runs there) and one for a
    GPU's, whose host work is copying a batch's bytes: an OpenMP team there shares the cores with the front-ends,
    spins, and every copy waits for its slowest member (docs/operations.md; docs/performance.md)."""
    if config.torch_threads:
        return config.torch_threads
    return len(os.sched_getaffinity(0)) if device.type == "cpu" else 1


def _watch_gpu(name: str, device: torch.device, runner: ModelRunner, metrics: Metrics) -> None:
    """GPU gauges, read at scrape time, never on the serving path. Utilisation needs NVML (the optional
    nvidia-ml-py package); torch.cuda.utilization maps CUDA_VISIBLE_DEVICES indices to NVML's for us."""
    metrics.gpu_allocated.labels(name).set_function(lambda: runner.memory()[0])
    metrics.gpu_reserved.labels(name).set_function(lambda: runner.memory()[1])
    try:
        torch.cuda.utilization(device)
    except Exception as exc:  # noqa: BLE001 - no pynvml, or NVML cannot see the device: no gauge
        log.info("no GPU utilisation gauge for %s (%s: %s)", name, type(exc).__name__, exc)
        return
    metrics.gpu_utilization.labels(name).set_function(lambda: torch.cuda.utilization(device) / 100.0)


