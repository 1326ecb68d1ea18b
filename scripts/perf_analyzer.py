"""Triton's own load generator, perf_analyzer (C++), against this server's Open Inference Protocol.

A second, independent client for the figures `resnet-client bench` gives, and the one Triton users
already trust. It sends what ModelMetadata declares (zeros: its random FP32 bytes include NaNs, which the
server refuses): `--input fp32` asks model resnet18, FP32 [1, 3, 224, 224] (600 KB a request); `--input
uint8` asks resnet18_uint8, UINT8 [1, 224, 224, 3] (150 KB, what `resnet-client bench --input uint8`
sends). It prints, per concurrency, its client-side throughput and latency, the server's own split of each
request's time (read from the ModelStatistics RPC before and after each window), and the CPU perf_analyzer
itself used (client_cores: its CPU seconds over its run's wall time, on a box it shares with the server).

The binary comes with the tritonclient 2.41 wheel (the test extra); it links libcudart.so.12 (the
nvidia-cuda-runtime-cu12 wheel, also in the test extra; no GPU needed) and libb64 (Debian's libb64-0d).

Usage: python scripts/perf_analyzer.py --server 127.0.0.1:50051 --concurrency 1,16 [--input uint8] [--streaming]
       [--shared-memory system] [--window-ms 5000]
Prints one JSON object a line, one per concurrency; talks only to the server named.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

# The model name whose declared input perf_analyzer sends, and the shape it needs for that input's free sizes.
INPUTS = {"fp32": ("resnet18", []), "uint8": ("resnet18_uint8", ["--shape", "input:224,224,3"])}
# perf_analyzer's report: "p50 latency: 28173 usec", "Throughput: 33.6 infer/sec", "Inference count: 111".
_NUMBER = r"([0-9.]+)"
CLIENT_FIELDS = {"requests": r"Request count: (\d+)", "throughput": rf"Throughput: {_NUMBER} infer/sec",
                 "avg_us": r"Avg latency: (\d+) usec", "p50_us": r"p50 latency: (\d+) usec",
                 "p90_us": r"p90 latency: (\d+) usec", "p99_us": r"p99 latency: (\d+) usec"}
SERVER_FIELDS = {"inferences": r"Inference count: (\d+)", "executions": r"Execution count: (\d+)",
                 "successes": r"Successful request count: (\d+)"}
SERVER_SPLIT = re.compile(r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec \+ compute "
                          r"input (\d+) usec \+ compute infer (\d+) usec \+ compute output (\d+) usec\)")
SPLIT_NAMES = ("request_us", "overhead_us", "queue_us", "compute_input_us", "compute_infer_us", "compute_output_us")
# A request's time in the server, part by part, in the order it passes them (how the tables print it).
REQUEST_PARTS = ("queue_us", "compute_input_us", "compute_infer_us", "compute_output_us", "overhead_us")


def part_label(name: str) -> str:
    """A part's name as the tables print it: compute_infer_us -> infer."""
    return name.removeprefix("compute_").removesuffix("_us")


def binary() -> str | None:
    """perf_analyzer beside this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    return str(beside) if beside.exists() else shutil.which("perf_analyzer")


def environment() -> dict[str, str]:
    """This environment, with the CUDA 12 runtime wheel's folder on the library path (the binary links it)."""
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime as cuda_runtime  # noqa: PLC0415 - optional: only perf_analyzer needs it
    except ImportError:
        return env
    folders = [str(Path(path) / "lib") for path in cuda_runtime.__path__]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(folders + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


def command(server: str, concurrency: int, window_ms: int | None, window_requests: int | None,
            first_windows: bool, input_kind: str = "fp32", streaming: bool = False,
            shared_memory: str = "none", protocol: str = "grpc") -> list[str]:
    """first_windows: report the first three windows whatever they read, instead of waiting (up to ten
    windows) for three within 10% of each other; for interleaving, where a run must take a known time.
    streaming: every request a message on ModelStreamInfer streams rather than a ModelInfer call.
    shared_memory: system sends each input and takes each output through regions under /dev/shm that
    perf_analyzer registers (the server needs --allow-client-shm). protocol: grpc, or http (the REST API with
    binary tensors; ``server`` is then the HTTP port's HOST:PORT)."""
    stability = ["--stability-percentage", "1000"] if first_windows or window_requests else []
    model, shape = INPUTS[input_kind]
    args = [binary() or "perf_analyzer", "-m", model, *shape, *(["--streaming"] if streaming else []),
            "-i", protocol, "-u", server, "-b", "1", "--shared-memory", shared_memory,
            "--input-data", "zero", "--concurrency-range", f"{concurrency}:{concurrency}", "--max-trials", "10",
            *stability]
    if window_requests:  # short windows for the tests: a count of requests each
        return args + ["--measurement-mode", "count_windows", "--measurement-request-count", str(window_requests)]
    return args + ["--measurement-interval", str(window_ms or 5000)]


def parse(report: str) -> dict:
    """The figures of one concurrency's report (the stable window's)."""
    client, _, server = report.rpartition("Request concurrency")[2].partition("Server:")
    figures: dict = {}
    for fields, text in ((CLIENT_FIELDS, client), (SERVER_FIELDS, server)):
        for name, pattern in fields.items():
            found = re.search(pattern, text)
            if found is None:
                raise ValueError(f"perf_analyzer's report has no {name!r} ({pattern}):\n{report}")
            figures[name] = float(found.group(1)) if "." in found.group(1) else int(found.group(1))
    split = SERVER_SPLIT.search(server)
    if split is None:
        raise ValueError(f"perf_analyzer's report has no server-side split:\n{report}")
    figures.update(zip(SPLIT_NAMES, map(int, split.groups()), strict=True))
    return figures


def run(server: str, concurrency: int, window_ms: int | None = None, window_requests: int | None = None,
        first_windows: bool = False, timeout: float = 300, input_kind: str = "fp32", streaming: bool = False,
        shared_memory: str = "none", protocol: str = "grpc") -> dict:
    args = command(server, concurrency, window_ms, window_requests, first_windows, input_kind, streaming,
                   shared_memory, protocol)
    cpu_before, started = _children_cpu_seconds(), time.monotonic()
    done = subprocess.run(args, env=environment(), capture_output=True, text=True, timeout=timeout)
    client_cores = (_children_cpu_seconds() - cpu_before) / (time.monotonic() - started)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return {"concurrency": concurrency, "input": input_kind, "streaming": streaming, "shared_memory": shared_memory,
            **parse(done.stdout),
            "client_cores": round(client_cores, 2)}


def _children_cpu_seconds() -> float:
    """User and system CPU of this process's finished children (perf_analyzer, once run returns)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="HOST:PORT of the server (its HTTP port with -i http)")
    parser.add_argument("-i", "--protocol", choices=("grpc", "http"), default="grpc",
                        help="grpc, or http: the REST API with binary tensors")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated request concurrencies")
    parser.add_argument("--window-ms", type=int, default=5000, help="perf_analyzer's measurement window")
    parser.add_argument("--input", choices=sorted(INPUTS), default="fp32",
                        help="the declared input to send: fp32 (model resnet18) or uint8 (model resnet18_uint8)")
    parser.add_argument("--streaming", action="store_true",
                        help="each request a message on a ModelStreamInfer stream, not a ModelInfer call")
    parser.add_argument("--shared-memory", choices=("none", "system"), default="none",
                        help="system: inputs and outputs through regions under /dev/shm (the server needs "
                             "--allow-client-shm)")
    args = parser.parse_args(argv)
    for concurrency in args.concurrency.split(","):
        figures = run(args.server, int(concurrency), window_ms=args.window_ms, input_kind=args.input,
                      streaming=args.streaming, shared_memory=args.shared_memory, protocol=args.protocol)
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
