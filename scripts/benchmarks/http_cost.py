"""HTTP beside gRPC: one server's Open Inference Protocol over gRPC (unary ModelInfer), over HTTP with Triton's
binary tensors, and over HTTP with JSON tensors, side by side in one run.

One ``resnet-server --frontends 1 --device cpu`` on 127.0.0.1 (seeded random weights) serving both ports, loaded
in turn by Triton's own clients (``tritonclient.grpc.aio`` and ``tritonclient.http.aio``, unchanged) with one uint8
224x224 image a request (``resnet18_uint8``), ``--concurrency`` calls in flight for ``--duration`` seconds, in
``--rounds`` rounds whose order rotates (a shared VM drifts from one minute to the next; a drift then falls on all
three alike). Reported per protocol: the median of the rounds' images/s and of the front-end process's CPU
milliseconds a request, and both against gRPC's. With ``--runner free`` (every forward pass ready-made) what is
left is the serving path itself: the issue's measure of the front-end's cost. The server is stopped (SIGTERM, by
PID) when done.

Usage: python scripts/benchmarks/http_cost.py [--concurrency 16] [--duration 10] [--rounds 3] [--runner free]
       [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np
import tritonclient.grpc.aio as grpc_client
import tritonclient.http.aio as http_client
from served import ServedProcess, serving

PORT = 50301
MODEL = "resnet18_uint8"
PROTOCOLS = ("grpc", "http binary", "http json")


def image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)


def caller(protocol: str, port: int) -> tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]:
    """One request of ``protocol`` as Triton's client sends it, and how to close that client."""
    pixels = image()
    if protocol == "grpc":
        client = grpc_client.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = grpc_client.InferInput("input", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels)
        return (lambda: client.infer(MODEL, [tensor])), client.close
    binary = protocol == "http binary"
    http = http_client.InferenceServerClient(f"127.0.0.1:{port + 1}", conn_limit=256)
    tensor = http_client.InferInput("input", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels, binary_data=binary)
    outputs = [http_client.InferRequestedOutput("probabilities", binary_data=binary)]
    return (lambda: http.infer(MODEL, [tensor], outputs=outputs)), http.close


async def closed_loop(call: Callable[[], Awaitable[object]], concurrency: int, duration: float) -> int:
    """Requests answered by ``concurrency`` callers, each sending its next once answered, for ``duration``
    seconds."""
    deadline = time.monotonic() + duration
    answered = 0

    async def one_caller() -> None:
        nonlocal answered
        while time.monotonic() < deadline:
            await call()
            answered += 1

    await asyncio.gather(*(one_caller() for _ in range(concurrency)))
    return answered


def measure(server: ServedProcess, protocol: str, concurrency: int, duration: float) -> tuple[float, float]:
    """Images/s and the front-end's CPU milliseconds a request over one window (after a second of warm-up)."""
    async def run() -> tuple[int, float, float]:
        call, close = caller(protocol, server.port)
        try:
            await closed_loop(call, concurrency, 1.0)
            cpu, started = server.frontend_cpu_seconds(), time.monotonic()
            answered = await closed_loop(call, concurrency, duration)
            return answered, time.monotonic() - started, server.frontend_cpu_seconds() - cpu
        finally:
            await close()
    answered, elapsed, cpu = asyncio.run(run())
    return answered / elapsed, cpu * 1000 / answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight (default 16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each protocol once a round (default 3)")
    parser.add_argument("--runner", default="model", help="the server's --runner: model, or free (default model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    flags = ["--http-port", str(PORT + 1), "--metrics-port", "0", "--runner", args.runner]
    with serving({PORT: flags}) as servers:
        server = servers[PORT]
        measured: dict[str, list[tuple[float, float]]] = {protocol: [] for protocol in PROTOCOLS}
        for round_index in range(args.rounds):
            shift = round_index % len(PROTOCOLS)
            for protocol in PROTOCOLS[shift:] + PROTOCOLS[:shift]:
                measured[protocol].append(measure(server, protocol, args.concurrency, args.duration))
    rate = {protocol: statistics.median(r for r, _ in points) for protocol, points in measured.items()}
    cpu = {protocol: statistics.median(c for _, c in points) for protocol, points in measured.items()}
    results = {protocol: {"images_per_s": rate[protocol], "rate_to_grpc": rate[protocol] / rate["grpc"],
                          "frontend_cpu_ms": cpu[protocol], "cpu_to_grpc": cpu[protocol] / cpu["grpc"],
                          "rounds": [[round(r, 1), round(c, 3)] for r, c in measured[protocol]]}
               for protocol in PROTOCOLS}
    if args.json:
        print(json.dumps({"runner": args.runner, "concurrency": args.concurrency, **results}))
    else:
        for protocol, row in results.items():
            print(f"{protocol:>11}  {row['images_per_s']:8.1f} images/s  x{row['rate_to_grpc']:.2f}  "
                  f"front-end {row['frontend_cpu_ms']:.3f} ms CPU a request  x{row['cpu_to_grpc']:.2f}  "
                  f"rounds {row['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
