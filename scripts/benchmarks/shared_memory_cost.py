"""What inputs by shared memory save: the same server loaded with each input by value and by reference.

One ``resnet-server --frontends 1 --allow-client-shm`` on 127.0.0.1 (``--runner free`` by default: no forward pass,
so what is left is the serving path, where the bytes are carried; ``--runner model`` for a CPU server's own
figures). Each load runs at ``--concurrency`` for about ``--duration`` seconds, by value then by reference, in
``--rounds`` rounds whose order alternates (a shared VM drifts; a drift then falls on both alike):

- Triton's perf_analyzer (``scripts/perf_analyzer.py``) on ``resnet18`` (FP32 [1, 3, 224, 224], 602 KB a request)
  and ``resnet18_uint8`` (UINT8 [1, 224, 224, 3], 150 KB), without and with ``--shared-memory system``;
- ``resnet-client bench`` with ``--input fp32`` and ``--input uint8`` (224x224), its own Classify calls by value
  and ModelInfer by reference with ``--shared-memory system``;
- ``grpc``: gRPC alone, the floor under both. A bare ``grpc.aio`` server on uvloop, as the front-end's
  (``grpc_floor.serve_aio``: one method that ignores its request and answers 4,000 bytes), sent the bytes of the
  ModelInferRequest perf_analyzer sends, by value (the image inline) and by reference (the input and four outputs
  named in regions). What it spends a call is what no handler can save: the front-end's saving by reference can
  be at most the ratio of its two costs, and less by whatever the handler spends on both.
- ``handler``: the same bare server and requests with the least handler there can be (``handler_floor.py``: the
  request read, the image copied in and its floats checked, the outputs written to their regions; no engine, no
  metrics): what a handler must add to gRPC's cost, and the ratio that is left.

Reported per load and input: the medians of the rounds' requests/s and of the front-end process's CPU time a
request (its /proc CPU time over the requests its /metrics counted in the same interval; the bare server's over
the calls its client made), and the ratios. The servers are stopped (SIGTERM, by PID; the bare one by an event)
when done.

Usage: python scripts/benchmarks/shared_memory_cost.py [--concurrency 16] [--duration 10] [--rounds 3]
       [--runner free|model] [--loads perf_analyzer,bench,grpc,handler] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import math
import re
import statistics
import sys
import urllib.request
from pathlib import Path

from frontend_cost import Server, bare_server, closed_loop, cpu_seconds
from grpc_floor import serve_aio
from handler_floor import OUTPUTS, REGIONS, serve_handler
from served import ServedProcess, serving

from resnet_client.api import grpc_predict_v2_pb2 as oip

SCRIPTS = Path(__file__).resolve().parent.parent
PORT, METRICS_PORT = 50211, 50212
INPUTS = ("fp32", "uint8")
FRONTEND_REQUESTS = re.compile(r'^resnet_requests_total\{code="OK",device="cpu",worker="0"\} (\S+)$', re.M)


@functools.cache  # loaded once, not once a measurement
def _perf_analyzer():
    spec = importlib.util.spec_from_file_location("perf_analyzer", SCRIPTS / "perf_analyzer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counters(server: ServedProcess) -> tuple[float, float]:
    """The front-end's CPU seconds and the requests it has answered."""
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as response:
        requests = FRONTEND_REQUESTS.search(response.read().decode())
    return server.frontend_cpu_seconds(), float(requests.group(1) if requests else 0)


def perf_analyzer_load(server: ServedProcess, input_kind: str, by_reference: bool, concurrency: int,
                       duration: float) -> float:
    """requests/s perf_analyzer reports over its first three windows."""
    figures = _perf_analyzer().run(f"127.0.0.1:{server.port}", concurrency, window_ms=int(duration * 1000 / 3),
                                   first_windows=True, input_kind=input_kind,
                                   shared_memory="system" if by_reference else "none")
    return float(figures["throughput"])


def bench_load(server: ServedProcess, input_kind: str, by_reference: bool, concurrency: int,
               duration: float) -> float:
    point = server.bench(duration, "--input", input_kind, "--image-size", "224x224", "--concurrency",
                         str(concurrency), "--metrics", "", *(["--shared-memory", "system"] if by_reference else []))
    return float(point["requests_per_s"])


def infer_request(input_kind: str, by_reference: bool) -> bytes:
    """The bytes of a ModelInferRequest as perf_analyzer sends it for one 224x224 image: the image inline, or the
    input and the four outputs named in regions."""
    shape, datatype, itemsize = ([1, 3, 224, 224], "FP32", 4) if input_kind == "fp32" else ([1, 224, 224, 3],
                                                                                            "UINT8", 1)
    size = math.prod(shape) * itemsize

    def in_region(name: str, byte_size: int) -> dict[str, oip.InferParameter]:
        return {"shared_memory_region": oip.InferParameter(string_param=name),
                "shared_memory_byte_size": oip.InferParameter(int64_param=byte_size)}

    tensor = oip.ModelInferRequest.InferInputTensor(name="input", datatype=datatype, shape=shape,
                                                    parameters=in_region("input_data", size) if by_reference else {})
    request = oip.ModelInferRequest(model_name="resnet18" if input_kind == "fp32" else "resnet18_uint8",
                                    inputs=[tensor])
    if by_reference:
        request.outputs.extend(oip.ModelInferRequest.InferRequestedOutputTensor(
            name=name, parameters=in_region(f"{name}_data", REGIONS[f"{name}_data"])) for name in OUTPUTS)
    else:
        request.raw_input_contents.append(bytes(size))
    return request.SerializeToString()


def bare_load(bare: Server, input_kind: str, by_reference: bool, concurrency: int, duration: float
              ) -> tuple[float, float]:
    """The bare server's calls/s and CPU milliseconds a call, this process sending it the request's bytes."""
    before = cpu_seconds(bare.processes)["bare"]
    counted, made = asyncio.run(closed_loop(bare.target, bare.method, concurrency, duration,
                                            infer_request(input_kind, by_reference)))
    return counted / duration, 1000 * (cpu_seconds(bare.processes)["bare"] - before) / max(made, 1)


LOADS = {"perf_analyzer": perf_analyzer_load, "bench": bench_load}  # against the server
BARE_SERVERS = {"grpc": serve_aio, "handler": serve_handler}  # each load its own bare server, sent bytes from here
LOAD_NAMES = (*LOADS, *BARE_SERVERS)


def measure(server: ServedProcess, bare: dict[str, Server], load: str, input_kind: str, by_reference: bool,
            concurrency: int, duration: float) -> tuple[float, float]:
    """requests/s, and the front-end's CPU milliseconds a request (for a bare server's load, that server's)."""
    if load in bare:
        return bare_load(bare[load], input_kind, by_reference, concurrency, duration)
    cpu_before, requests_before = counters(server)
    rate = LOADS[load](server, input_kind, by_reference, concurrency, duration)
    cpu_after, requests_after = counters(server)
    return rate, 1000 * (cpu_after - cpu_before) / max(requests_after - requests_before, 1)


def summary(points: dict[bool, list[tuple[float, float]]]) -> dict[str, object]:
    def median(by_reference: bool, index: int) -> float:
        return statistics.median(point[index] for point in points[by_reference])

    return {"by_value_requests_per_s": median(False, 0), "by_reference_requests_per_s": median(True, 0),
            "throughput_ratio": median(True, 0) / median(False, 0),
            "by_value_frontend_cpu_ms": median(False, 1), "by_reference_frontend_cpu_ms": median(True, 1),
            "frontend_cpu_saved": median(False, 1) / max(median(True, 1), 1e-9),
            "rounds": {"by_value": [round(rate, 1) for rate, _ in points[False]],
                       "by_reference": [round(rate, 1) for rate, _ in points[True]]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a measurement (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measurement once a round (default 3)")
    parser.add_argument("--runner", choices=("free", "model"), default="free",
                        help="the server's --runner (default free: the serving path alone)")
    parser.add_argument("--loads", default=",".join(LOAD_NAMES),
                        type=lambda text: [load for load in text.split(",") if load],
                        help=f"comma-separated: {', '.join(LOAD_NAMES)} (default all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if unknown := set(args.loads) - set(LOAD_NAMES):
        parser.error(f"argument --loads: unknown {sorted(unknown)}; choose from {', '.join(LOAD_NAMES)}")
    measured = {(load, kind): {False: [], True: []} for load in args.loads for kind in INPUTS}
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(serving({PORT: ["--metrics-port", str(METRICS_PORT), "--metrics-host",
                                                       "127.0.0.1", "--runner", args.runner,
                                                       "--allow-client-shm"]}))[PORT]
        bare = {load: servers.enter_context(bare_server("uvloop", serve))
                for load, serve in BARE_SERVERS.items() if load in args.loads}
        for round_index in range(args.rounds):
            for (load, kind), points in measured.items():
                for by_reference in (bool(round_index % 2), not round_index % 2):
                    points[by_reference].append(measure(server, bare, load, kind, by_reference, args.concurrency,
                                                        args.duration))
    results = {f"{load} {kind}": summary(points) for (load, kind), points in measured.items()}
    if args.json:
        print(json.dumps(results))
        return 0
    for name, row in results.items():
        who = "bare server" if name.split()[0] in BARE_SERVERS else "front-end"
        print(f"{name:>20}  {row['by_value_requests_per_s']:7.1f} -> {row['by_reference_requests_per_s']:7.1f} req/s "
              f"(x{row['throughput_ratio']:.2f})  {who} {row['by_value_frontend_cpu_ms']:.3f} -> "
              f"{row['by_reference_frontend_cpu_ms']:.3f} ms CPU a request ({row['frontend_cpu_saved']:.2f}x less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
