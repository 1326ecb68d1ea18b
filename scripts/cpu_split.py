"""Where the cores go while a server answers a closed loop: CPU seconds per answered image, by part.

Runs a closed loop of one-image uint8 requests from this process and, over a window after a ramp, reads
the CPU time of every thread of the server process (/proc/PID/task/*/stat, Linux) and of this process.
The parts: the server's forward team (its busiest threads: the replica's worker and its OpenMP helpers,
which also convert the raw images), the server's event loop (its main thread) and its other threads
(gRPC, preprocessing, metrics), and the client. Each is given in milliseconds per answered image and as a
share of what the machine had: cores x wall time. Whatever the client and the server's other threads take
is not there for the forward pass when they share the cores, which is how it is measured here.

Usage: python scripts/cpu_split.py --server 127.0.0.1:50151 --server-pid PID [--concurrency 16]
       [--image-size 224x224] [--ramp 3] [--window 15] [--team 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from client.api import classifier_pb2 as pb
from client.bench import make_image
from client.client import AsyncClient
from client.flags import image_size

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of ``pid``, by thread id."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND  # utime, stime
    return seconds


def split(pid: int, before: dict[int, float], after: dict[int, float], team: int) -> dict[str, float]:
    """The server's CPU seconds over the window: its ``team`` busiest threads, its main thread, the rest."""
    used = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    loop = used.pop(pid, 0.0)
    busiest = sorted(used.values(), reverse=True)
    return {"forward_team": sum(busiest[:team]), "event_loop": loop, "other_threads": sum(busiest[team:])}


async def measure(args: argparse.Namespace) -> dict:
    request = pb.ClassifyRequest(images=[make_image("uint8", *args.image_size)])
    answered = 0
    stop = asyncio.Event()
    async with AsyncClient(args.server) as client:
        stub = client._stub  # the prepared message as is, as resnet-client bench sends it

        async def caller() -> None:
            nonlocal answered
            while not stop.is_set():
                await stub.Classify(request, timeout=60)
                answered += 1

        callers = [asyncio.create_task(caller()) for _ in range(args.concurrency)]
        await asyncio.sleep(args.ramp)  # the loop fills and its batches settle
        start = (time.perf_counter(), time.process_time(), thread_cpu_seconds(args.server_pid), answered)
        await asyncio.sleep(args.window)
        end = (time.perf_counter(), time.process_time(), thread_cpu_seconds(args.server_pid), answered)
        stop.set()
        await asyncio.gather(*callers)
    wall, images = end[0] - start[0], end[3] - start[3]
    seconds = {**split(args.server_pid, start[2], end[2], args.team), "client": end[1] - start[1]}
    cores = len(os.sched_getaffinity(0))
    capacity = cores * wall
    return {"concurrency": args.concurrency, "image_size": list(args.image_size), "window_s": wall,
            "images": images, "images_per_s": images / wall, "cores": cores,
            "cpu_ms_per_image": {part: 1000 * used / images for part, used in seconds.items()},
            "share_of_cores": {**{part: used / capacity for part, used in seconds.items()},
                               "unaccounted": 1 - sum(seconds.values()) / capacity}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="host:port of the server")
    parser.add_argument("--server-pid", type=int, required=True, help="its process id, to read its threads' CPU time")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--image-size", type=image_size, default=(224, 224))
    parser.add_argument("--ramp", type=float, default=3.0, help="seconds of load before the window opens")
    parser.add_argument("--window", type=float, default=15.0, help="seconds measured")
    parser.add_argument("--team", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of the forward pass (the replica's torch threads; default every core)")
    print(json.dumps(asyncio.run(measure(parser.parse_args()))))


if __name__ == "__main__":
    main()
