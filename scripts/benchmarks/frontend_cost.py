"""The front-end's own cost per call: one front-end process with a free model against bare grpc.aio.

Measures, side by side in one run on this machine: (1) a bare ``grpc.aio`` server in one process, whose one
method ignores its request and answers 4,000 bytes; (2) ``resnet-server --frontends 1`` with a model that costs
nothing (``--runner free``: every forward pass is ready-made), so what is left is the serving
path itself: gRPC, the handler, validation, the slab, the engine's hand-offs and the answer. Both take the same
150 KB requests (one uint8 224x224 image, as a ClassifyRequest) from the same client: ``--processes`` processes
of ``--concurrency`` calls in flight each, for ``--duration`` seconds after a second of warm-up. Both servers
run throughout and are measured in ``--rounds`` rounds, each server once a round, which goes first alternating:
on a shared VM the same server's calls a second drift by a quarter from one minute to the next, and a drift
then falls on both alike. Reported: the median of the rounds' ratios of calls a second, and each server
process's CPU time a call (median of the rounds; warm-up included, over every call made): on a machine whose
cores the clients share, a steadier measure than calls a second, and it says whether the front-end or its
engine costs what. The front-end's over the bare server's, taken round by round (the two halves of a round share
its drift) and the median of those, is the issue's target (at most 1.5). The bare server
runs on asyncio's own event loop, the issue's reference; the front-end on uvloop where installed
(resnet_server.common.event_loop), so ``--bare-loop uvloop`` gives the front-end's own cost alone. Both servers listen
on 127.0.0.1 and are stopped when done.

Usage: python scripts/benchmarks/frontend_cost.py [--processes 4] [--concurrency 16] [--duration 10] [--rounds 3]
       [--server-flags "..."] [--bare-loop asyncio|uvloop] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import grpc
from cpu_split import thread_cpu_seconds
from grpc_floor import serve_aio  # its folder is the first path entry, and its spawned children's

from resnet_client.api import classifier_pb2 as pb

STARTED = re.compile(r"started resnet-(engine|frontend)-\S+ \(pid (\d+)\)")  # the supervisor's log line
BARE_METHOD = "/floor.Floor/Call"  # grpc_floor's server: one method that answers 4,000 bytes
CLASSIFY = "/resnet.v1.Classifier/Classify"
CPU_RATIO_TARGET = 1.5  # the front-end's CPU a call over the bare server's, at most (issue 59)


class Server(NamedTuple):
    target: str  # host:port
    method: str  # the method the load calls
    processes: dict[str, int]  # each of its processes' pid, by name


REQUEST = pb.ClassifyRequest(images=[pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.UINT8, shape=[224, 224, 3],
                                                               data=bytes(224 * 224 * 3)))], top_k=1)


async def closed_loop(target: str, method: str, concurrency: int, duration: float, payload: bytes) -> tuple[int, int]:
    """``concurrency`` calls in flight on one channel, each sending ``payload``, for a second of warm-up and then
    ``duration`` seconds: how many ended in the window and how many were made in all."""
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: the same client work for every server
        start = time.monotonic() + 1.0
        end = start + duration
        counted = made = 0

        async def caller() -> None:
            nonlocal counted, made
            while time.monotonic() < end:
                await call(payload, timeout=30)
                counted += start <= time.monotonic() < end
                made += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return counted, made


def load(target: str, method: str, concurrency: int, duration: float, results) -> None:
    """One client process of REQUEST calls (closed_loop); sends how many ended in the window and how many in all."""
    results.send(asyncio.run(closed_loop(target, method, concurrency, duration, REQUEST.SerializeToString())))


def calls_per_second(server: Server, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """Calls a second in the window, and the CPU microseconds a call of each of the server's processes."""
    context = multiprocessing.get_context("spawn")
    before = cpu_seconds(server.processes)
    pipes = []
    for _ in range(args.processes):
        receiver, sender = context.Pipe(duplex=False)
        context.Process(target=load, args=(server.target, server.method, args.concurrency, args.duration,
                                           sender)).start()
        pipes.append(receiver)
    counted, made = map(sum, zip(*(pipe.recv() for pipe in pipes), strict=True))
    after = cpu_seconds(server.processes)
    return counted / args.duration, {name: 1e6 * (after[name] - before[name]) / made for name in server.processes}


def cpu_seconds(processes: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each process (all its threads; not its children)."""
    return {name: sum(seconds for (process, _), seconds in thread_cpu_seconds(pid).items() if process == pid)
            for name, pid in processes.items()}


@contextlib.contextmanager
def bare_server(loop: str, serve=serve_aio) -> Iterator[Server]:
    """A bare gRPC server in a process of its own (``serve``: grpc_floor.serve_aio, or a function that serves as
    it does), stopped at the end."""
    context = multiprocessing.get_context("spawn")
    ports, stop = context.Queue(), context.Event()
    server = context.Process(target=serve, args=(ports, stop, loop))
    server.start()
    try:
        yield Server(f"127.0.0.1:{ports.get(timeout=60)}", BARE_METHOD, {"bare": server.pid})
    finally:
        stop.set()
        server.join(10)


@contextlib.contextmanager
def frontend_server(args: argparse.Namespace) -> Iterator[Server]:
    server = subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--runner", "free", "--frontends", "1", "--device", "cpu",
         "--weights", "random", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--max-batch-size", "64",
         "--max-queue", "1024",
         *shlex.split(args.server_flags)],
        stderr=subprocess.PIPE, text=True)
    processes = {}
    try:
        for line in server.stderr:  # the supervisor's children, then the front-end's "serving resnet18 on ..." line
            if started := STARTED.search(line):
                processes[started[1]] = int(started[2])
            if "serving resnet18 on " in line:
                port = int(line.split("127.0.0.1:")[1].split()[0])
                break
        else:
            raise SystemExit("the server ended before it served")
        threading.Thread(target=server.stderr.read, daemon=True).start()  # its later lines must not fill the pipe
        yield Server(f"127.0.0.1:{port}", CLASSIFY, processes)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def measure(args: argparse.Namespace) -> dict:
    """Both servers, ``args.rounds`` times; the medians, and every round's ratio."""
    rounds = []
    with bare_server(args.bare_loop) as bare, frontend_server(args) as frontend:
        for number in range(args.rounds):
            order = [("bare", bare), ("frontend", frontend)]
            if number % 2:
                order.reverse()
            rounds.append({name: calls_per_second(server, args) for name, server in order})
    ratios = [measured["frontend"][0] / measured["bare"][0] for measured in rounds]
    # Each round's front-end CPU a call over the bare server's in the same round: a drift of the machine's speed
    # falls on both halves of a round alike, so the ratio of a pair holds still where either side moves.
    cpu_ratios = [measured["frontend"][1]["frontend"] / measured["bare"][1]["bare"] for measured in rounds]
    cpu = {name: statistics.median(measured[server][1][name] for measured in rounds)
           for server in ("bare", "frontend") for name in rounds[0][server][1]}
    return {"bare_calls_per_s": statistics.median(measured["bare"][0] for measured in rounds),
            "frontend_calls_per_s": statistics.median(measured["frontend"][0] for measured in rounds),
            "ratio": statistics.median(ratios), "ratios": ratios, "cpu_us_per_call": cpu,
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios, "cpu_ratio_target": CPU_RATIO_TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--processes", type=int, default=min(4, os.cpu_count() or 1), help="client processes")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight per client process")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per server and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring both servers once")
    parser.add_argument("--server-flags", default="", help="more resnet-server flags for the front-end's side")
    parser.add_argument("--bare-loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the bare server's event loop: asyncio's own (the target's reference), or uvloop (as the "
                             "front-end's, by default: its own cost alone)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a line of text")
    args = parser.parse_args()
    result = {**measure(args), "bare_loop": args.bare_loop, "processes": args.processes,
              "concurrency": args.concurrency, "duration_s": args.duration, "rounds": args.rounds,
              "cores": len(os.sched_getaffinity(0))}
    print(json.dumps(result) if args.json else
          f"bare grpc.aio ({args.bare_loop}) {result['bare_calls_per_s']:.0f} calls/s, one front-end with a free model "
          f"{result['frontend_calls_per_s']:.0f} calls/s (medians of {args.rounds} rounds): {result['ratio']:.2f} x "
          f"(rounds {', '.join(f'{ratio:.2f}' for ratio in result['ratios'])}); CPU a call: "
          + ", ".join(f"{name} {us:.0f} us" for name, us in result["cpu_us_per_call"].items())
          + f"; the front-end's {result['cpu_ratio']:.2f} x the bare server's (median of the rounds' "
          f"{', '.join(f'{ratio:.2f}' for ratio in result['cpu_ratios'])}; target <= {CPU_RATIO_TARGET})")


if __name__ == "__main__":
    main()
