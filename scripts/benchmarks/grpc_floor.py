"""The floor of a unary round trip in Python gRPC on this machine, without this project's server.

A minimal server (grpc.aio, then the thread-pool server) with one method that ignores its request and
answers 4,000 bytes, about a ClassifyResponse; a blocking client times 400 calls with an empty request and
400 with 150,528 bytes (a 224x224 uint8 image), after 50 to warm up. Each server runs in its own process
on a free port of 127.0.0.1 and is stopped when its calls are done. What the served c=1 latency cannot go
below, whatever the serving path does.

With ``--message-mb N``, each server then receives one message of N MiB (a weights file sent with
RepositoryModelLoad is 44.7) while its resident memory is sampled every 2 ms: its peak rise over the RSS
before, in MiB and in copies of the message. What a server's memory rises by before any handler of its own
runs (grpcio 1.85 holds three copies: the received slices, a bytearray and the bytes made from it).

Usage: python scripts/benchmarks/grpc_floor.py [--calls 400] [--message-mb 44.7]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

ANSWER = b"x" * 4000
IMAGE = bytes(224 * 224 * 3)
OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


def _one_method(method) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("floor.Floor", {"Call": grpc.unary_unary_rpc_method_handler(method)})


async def _answer(request: bytes, context) -> bytes:
    return ANSWER


def serve_aio(ports, stop, loop: str = "asyncio", method=_answer) -> None:
    """Serve ``method`` (by default one that ignores its request) on ``loop`` (asyncio's own, or uvloop) until
    ``stop`` is set."""
    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_one_method(method),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(0)

    # Not resnet_server.common.event_loop.run: importing the server package tunes malloc
    # (resnet_server.common.memory), and the reference server must stay bare.
    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def serve_threads(ports, stop) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    server.add_generic_rpc_handlers((_one_method(lambda request, context: ANSWER),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports.put(port)
    stop.wait()
    server.stop(0)


def median_round_trip_ms(port: int, payload: bytes, calls: int) -> float:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/floor.Floor/Call")
        for _ in range(50):
            call(payload, timeout=10)
        latencies = []
        for _ in range(calls):
            started = time.perf_counter()
            answer = call(payload, timeout=10)
            latencies.append(1000 * (time.perf_counter() - started))
            if len(answer) != len(ANSWER):
                raise SystemExit(f"answer of {len(answer)} bytes, expected {len(ANSWER)}")
    return statistics.median(latencies)


def resident_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def receive_rise_mb(pid: int, port: int, size: int) -> float:
    """The server's peak RSS while it receives one ``size``-byte message, over its RSS just before."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/floor.Floor/Call")
        call(b"", timeout=10)  # connected and warm before the baseline
        message = bytes(size)
        before = resident_mb(pid)
        peak, done = [before], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], resident_mb(pid))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            call(message, timeout=120)
        finally:
            done.set()
            sampler.join()
    return peak[0] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--message-mb", type=float, default=0.0,
                        help="then send each server one message of this many MiB and report its peak RSS rise")
    args = parser.parse_args()
    if not 0 <= args.message_mb <= 60:
        parser.error(f"argument --message-mb: must be between 0 and 60 (the servers take up to 64 MiB), got "
                     f"{args.message_mb}")
    for name, serve in (("grpc.aio server", serve_aio), ("thread-pool server", serve_threads)):
        ports, stop = multiprocessing.Queue(), multiprocessing.Event()
        server = multiprocessing.Process(target=serve, args=(ports, stop))
        server.start()
        try:
            port = ports.get(timeout=30)
            empty = median_round_trip_ms(port, b"", args.calls)
            image = median_round_trip_ms(port, IMAGE, args.calls)
            print(f"{name}: empty request {empty:.2f} ms, 150 KB request {image:.2f} ms (medians of {args.calls})")
            if args.message_mb:
                rise = receive_rise_mb(server.pid, port, int(args.message_mb * 2**20))
                print(f"{name}: one {args.message_mb:g} MiB message raised its RSS by {rise:.0f} MiB "
                      f"({rise / args.message_mb:.1f} copies)")
        finally:
            stop.set()
            server.join(10)


if __name__ == "__main__":
    main()
