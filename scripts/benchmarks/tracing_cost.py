"""What tracing costs the serving path: the same server with tracing off, at --trace-rate 0.01 and at 1.0.

Three ``resnet-server --frontends 1`` with ``--runner free`` (by default: no forward pass, so what is left is the
serving path, where tracing's work is; ``--runner model`` measures what a CPU server loses) on 127.0.0.1, the traced
two exporting to an OTLP/gRPC receiver in this process that counts and drops the spans. Each is loaded in turn by
``resnet-client bench --input uint8 --image-size 224x224`` at ``--concurrency`` for ``--duration`` seconds, in
``--rounds`` rounds whose order rotates (a shared VM drifts from one minute to the next; a drift then falls on all
three alike). Reported per setting: the median of the rounds' images/s, its ratio to tracing off, and the front-end
process's CPU time a call (from /proc); and the spans the receiver got. The servers are stopped (SIGTERM, by PID)
when done.

Usage: python scripts/benchmarks/tracing_cost.py [--concurrency 16] [--duration 10] [--rounds 3]
       [--runner free|model] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from served import ServedProcess, in_rotating_rounds, serving

SETTINGS = {"off": [], "rate 0.01": ["--trace-rate", "0.01"], "rate 1.0": ["--trace-rate", "1.0"]}
BASE_PORT = 50191


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Counts the spans exported to it."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        count = sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
        with self._lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def measure(server: ServedProcess, concurrency: int, duration: float) -> tuple[float, float]:
    """images/s, and the front-end's CPU seconds a call, over one bench window."""
    before = server.frontend_cpu_seconds()
    point = server.bench(duration, "--input", "uint8", "--image-size", "224x224", "--concurrency", str(concurrency))
    calls = point["requests_per_s"] * duration
    return point["images_per_s"], (server.frontend_cpu_seconds() - before) / max(calls, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight (default 16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each setting once a round (default 3)")
    parser.add_argument("--runner", choices=("free", "model"), default="free",
                        help="the servers' --runner (default free: the serving path alone)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    receiver = Receiver()
    endpoint = ["--otlp-endpoint", f"127.0.0.1:{receiver.port}"]
    flags_by_port = {BASE_PORT + index: ["--metrics-port", "0", "--runner", args.runner, *setting,
                                         *(endpoint if setting else [])]
                     for index, setting in enumerate(SETTINGS.values())}
    try:
        with serving(flags_by_port) as by_port:
            measured = in_rotating_rounds(dict(zip(SETTINGS, by_port.values(), strict=True)), args.rounds,
                                          lambda server: measure(server, args.concurrency, args.duration))
    finally:
        receiver.server.stop(0)
    off = statistics.median(rate for rate, _ in measured["off"])
    results: dict[str, object] = {name: {"images_per_s": statistics.median(rate for rate, _ in points),
                      "ratio_to_off": statistics.median(rate for rate, _ in points) / off,
                      "frontend_cpu_ms_a_call": statistics.median(cpu for _, cpu in points) * 1000,
                      "rounds": [round(rate, 1) for rate, _ in points]}
               for name, points in measured.items()}
    results["spans_received"] = receiver.spans
    if args.json:
        print(json.dumps(results))
    else:
        for name in SETTINGS:
            row = results[name]
            assert isinstance(row, dict)
            print(f"{name:>10}  {row['images_per_s']:8.1f} images/s  x{row['ratio_to_off']:.3f}  "
                  f"front-end {row['frontend_cpu_ms_a_call']:.3f} ms CPU a call  rounds {row['rounds']}")
        print(f"spans received: {receiver.spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
