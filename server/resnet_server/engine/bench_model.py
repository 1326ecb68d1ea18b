"""``resnet-server bench-model``: the in-process ceiling the served throughput is measured against.

No gRPC: the same ModelRunner (device, precision, weights) timed over a list of batch sizes, and,
separately, decode + preprocess for the chosen input kind, then both in series (what one image
costs the server's CPU when it also has to be decoded). Given a device list, it lays the replicas out
as the server does (one runner per listed device, each on its own thread with ``--torch-threads``
threads) and times them all at once: the ceiling of ``--device cpu,cpu`` or ``cuda:0,cuda:1`` is what
those replicas compute together.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from resnet_client.flags import (
    DEFAULT_IMAGE_SIZE,
    comma_list,
    image_size,
    int_between,
    non_negative_int,
    positive_float,
    size_text,
)
from resnet_server.common.config import (
    MAX_BATCH_SIZE_LIMIT,
    ConfigError,
    _boolean,
    _compile_mode,
    _device_list,
    _onnx_provider,
    _precision,
    _runtime,
    graph_problem,
    parse_config,
    weights_source,
)
from resnet_server.common.devices import resolve_devices
from resnet_server.common.model import build_model, load_weights
from resnet_server.common.preprocess import EncodedImage, RawImage, preprocess
from resnet_server.common.threads import use_torch_threads
from resnet_server.engine.onnx_runtime import OnnxNetwork
from resnet_server.engine.runner import ModelRunner

MAX_PIXELS = 40_000_000


def sample_input(kind: str, width: int, height: int, seed: int = 0):
    """One image of the chosen kind, as the server would receive it."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    if kind in ("jpeg", "png"):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format=kind.upper())
        return EncodedImage(buffer.getvalue())
    if kind == "uint8":
        return RawImage("uint8", pixels.shape, pixels.tobytes())
    return RawImage("float32", (3, 224, 224), rng.standard_normal((3, 224, 224), dtype=np.float32).tobytes())


def timed_rate(step: Callable[[], int], duration: float, warmup: int = 2) -> tuple[float, list[float]]:
    """Items per second of ``step`` (which returns how many items it did), run for about ``duration``,
    and the seconds each call took."""
    for _ in range(warmup):
        step()
    done, calls, started = 0, [], time.perf_counter()
    while (elapsed := time.perf_counter() - started) < duration:
        call_started = time.perf_counter()
        done += step()
        calls.append(time.perf_counter() - call_started)
    return done / elapsed, calls


def call_percentiles_ms(calls: list[float]) -> dict[str, float]:
    """Median and 99th percentile of one call, in ms: the spread the machine alone puts on a fixed amount
    of work, to set beside the served p99/p50."""
    ordered = sorted(calls)
    return {"p50": 1000.0 * statistics.median(ordered),
            "p99": 1000.0 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    with Replicas(args, args.batch_sizes) as replicas:
        image = sample_input(args.input, *args.image_size)
        model_input = preprocess(image, MAX_PIXELS)
        forward, call_ms = {}, {}
        for size in args.batch_sizes:
            forward[size], calls = replicas.rate(model_input, size, args.duration)
            call_ms[size] = call_percentiles_ms(calls)
    # On this thread, one torch thread: as the server's preprocessing threads run it.
    preprocess_rate, _ = timed_rate(lambda: (preprocess(image, MAX_PIXELS), 1)[1], args.duration)
    best = max(forward, key=lambda size: forward[size])
    serial = 1.0 / (1.0 / forward[best] + 1.0 / preprocess_rate)
    return {"device": ",".join(str(runner.device) for runner in replicas.runners), "replicas": len(replicas.runners),
            "precision": args.precision, "runtime": replicas.runners[0].runtime, "compiled": args.compile,
            "compile_mode": args.compile_mode if args.compile else None, "torchscript": args.torchscript,
            "cuda_graphs": all(runner.cuda_graphs for runner in replicas.runners),  # what ran: eager on a CPU
            "fold_batch_norms": args.fold_batch_norms, "input": args.input,
            "image_size": list(args.image_size), "forward_images_per_s": forward,
            "forward_call_ms": call_ms, "best_batch_size": best, "preprocess_images_per_s": preprocess_rate,
            "ceiling_with_preprocess_images_per_s": serial,
            "batch1_latency_ms": len(replicas.runners) * 1000.0 / forward[1] if 1 in forward else None,
            "batch1_latency_p50_ms": call_ms[1]["p50"] if 1 in forward else None,
            "torch_threads": replicas.threads}


class Replicas:
    """One runner per listed device (``args``: the flags of :func:`add_model_arguments`), each built, warmed
    (compiled, with --compile) and timed on a thread of its own that lives as long as this object, with
    ``--torch-threads`` torch threads: the server's replica workers.

    The calling thread is set to one torch thread, as the server's other threads are: an OpenMP team of its
    own would slow the replicas' teams (see resnet_server.common.threads)."""

    def __init__(self, args: argparse.Namespace, batch_sizes: list[int]) -> None:
        use_torch_threads(1)
        self.threads = args.torch_threads or len(os.sched_getaffinity(0))
        devices = resolve_devices(args.device)
        # ONNX Runtime's own pool computes its forward pass: the thread keeps one torch thread, as the engine's does.
        onnx = args.runtime == "onnxruntime" or args.weights.endswith(".onnx")
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"bench-{device}", initializer=use_torch_threads,
                                            initargs=(1 if onnx else self.threads,))
                         for device in devices]
        # One at a time: compilations do not overlap, and a failure stops the rest.
        self.runners = [worker.submit(_warmed_runner, args, device, batch_sizes, self.threads).result()
                        for worker, device in zip(self._workers, devices, strict=True)]

    def rate(self, model_input: torch.Tensor, size: int, duration: float) -> tuple[float, list[float]]:
        """Images/s of every runner's forward pass at ``size`` run at once, and the seconds each call took,
        all runners together."""
        start = threading.Barrier(len(self.runners))
        futures = [worker.submit(_timed_forward, runner, model_input, size, duration, start)
                   for worker, runner in zip(self._workers, self.runners, strict=True)]
        if failures := [error for future in futures if (error := future.exception())]:
            raise next((error for error in failures if not isinstance(error, threading.BrokenBarrierError)),
                       failures[0])
        results = [future.result() for future in futures]
        return sum(rate for rate, _ in results), [call for _, calls in results for call in calls]

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for worker in self._workers:
            worker.shutdown()


def _warmed_runner(args: argparse.Namespace, device: torch.device, batch_sizes: list[int], threads: int
                   ) -> ModelRunner:
    if args.weights.endswith(".onnx"):  # a model served as it is (resnet-server quantize's int8)
        runner = ModelRunner(None, device, args.precision, runtime="onnxruntime", threads=threads,
                             network=OnnxNetwork(Path(args.weights), threads, args.onnx_provider))
    else:
        runner = ModelRunner(build_model(load_weights(args.weights, device), device), device, args.precision,
                             channels_last=args.channels_last, compiled=args.compile, compile_mode=args.compile_mode,
                             fold_batch_norms=args.fold_batch_norms, torchscript=args.torchscript,
                             cuda_graphs=args.cuda_graphs, runtime=args.runtime, threads=threads,
                             compile_cache=args.compile_cache, onnx_provider=args.onnx_provider)
    runner.warm_up(batch_sizes)
    return runner


def _timed_forward(runner: ModelRunner, model_input: torch.Tensor, size: int, duration: float,
                   start: threading.Barrier) -> tuple[float, list[float]]:
    """One replica's part of Replicas.rate, on its own thread: the forward pass at ``size``, timed from the
    moment every replica is ready."""
    batch, temperatures = model_input.expand(size, -1, -1, -1).contiguous(), torch.ones(size)

    def forward() -> int:
        return len(runner(batch, temperatures)[0])

    try:
        forward(), forward()
        start.wait()
    except BaseException:
        start.abort()  # the other replicas must not wait for this one
        raise
    return timed_rate(forward, duration, warmup=0)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which model runs where, as resnet-server takes them."""
    parser.add_argument("--device", type=_device_list, default=("cpu",),
                        help="device list as resnet-server takes it; several replicas are timed at once "
                             "(default cpu)")
    parser.add_argument("--torch-threads", type=non_negative_int, default=0,
                        help="torch threads per replica, as resnet-server --torch-threads (0: every core)")
    parser.add_argument("--precision", type=_precision, default="fp32",
                        help="fp32, fp16, bf16 or int8, as resnet-server --precision (default %(default)s)")
    parser.add_argument("--weights", type=weights_source, default="random",
                        help="as resnet-server --weights (default %(default)s: speed does not depend on them); an "
                             ".onnx file with --runtime onnxruntime")
    parser.add_argument("--runtime", type=_runtime, default="torch",
                        help="torch or onnxruntime, as resnet-server --runtime (default %(default)s)")
    parser.add_argument("--onnx-provider", type=_onnx_provider, default="auto",
                        help="as resnet-server --onnx-provider (default %(default)s)")
    parser.add_argument("--compile-cache", default=None,
                        help="as resnet-server --compile-cache: where --runtime onnxruntime keeps its export")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as resnet-server --compile")
    parser.add_argument("--compile-mode", type=_compile_mode, default="default",
                        help="as resnet-server --compile-mode (needs --compile)")
    parser.add_argument("--torchscript", action="store_true", help="a frozen TorchScript graph, as resnet-server "
                                                                   "--torchscript")
    parser.add_argument("--cuda-graphs", action="store_true", help="one CUDA graph per batch size, as resnet-server "
                                                                   "--cuda-graphs")
    parser.add_argument("--channels-last", type=_boolean, default=True, help="as resnet-server --channels-last")
    parser.add_argument("--fold-batch-norms", type=_boolean, default=True,
                        help="fold batch norms into the convolutions, as the server always does (false: to measure "
                             "what folding saves)")


def parse_model_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, refusing what the server refuses too: a compile mode without --compile, two of --compile,
    --torchscript and --cuda-graphs."""
    args = parser.parse_args(argv)
    if problem := graph_problem(args.compile, args.compile_mode, args.torchscript, args.cuda_graphs):
        parser.error(problem)
    try:  # the server's own checks of the runtime, precision and weights together
        parse_config(["--runtime", args.runtime, "--precision", args.precision, "--weights", args.weights,
                      "--device", ",".join(args.device)], env={})
    except ConfigError as exc:
        parser.error(str(exc))
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resnet-server bench-model", description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", type=comma_list(int_between(1, MAX_BATCH_SIZE_LIMIT)),
                        default=[1, 4, 8, 16, 32], help="forward-pass batch sizes to time, each at most "
                                                        f"{MAX_BATCH_SIZE_LIMIT} (default 1,4,8,16,32)")
    parser.add_argument("--input", choices=["jpeg", "png", "uint8", "fp32"], default="uint8",
                        help="the input kind whose decode + preprocess is timed (default %(default)s)")
    parser.add_argument("--image-size", type=image_size, default=DEFAULT_IMAGE_SIZE,
                        help=f"WxH of the sample image (default {size_text(DEFAULT_IMAGE_SIZE)})")
    parser.add_argument("--duration", type=positive_float, default=5.0,
                        help="seconds per measurement (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="the results as one JSON object")
    return parser


def main(argv: Sequence[str]) -> int:
    args = parse_model_arguments(build_parser(), argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"device {result['device']}  runtime {result['runtime']}  precision {result['precision']}  "
          f"compile {result['compile_mode'] or 'off'}  "
          f"torchscript {'on' if result['torchscript'] else 'off'}  "
          f"cuda graphs {'on' if result['cuda_graphs'] else 'off'}  torch threads {result['torch_threads']}")
    for size, rate in result["forward_images_per_s"].items():
        call = result["forward_call_ms"][size]
        print(f"  forward batch {size:>4}: {rate:9.1f} images/s  one call p50 {call['p50']:.1f} ms, "
              f"p99 {call['p99']:.1f} ms")
    print(f"  decode+preprocess ({args.input} {size_text(args.image_size)}): "
          f"{result['preprocess_images_per_s']:9.1f} images/s")
    print(f"  ceiling with preprocess (best batch {result['best_batch_size']}): "
          f"{result['ceiling_with_preprocess_images_per_s']:9.1f} images/s")
    return 0
