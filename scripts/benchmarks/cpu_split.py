"""Where the cores go while a server answers a closed loop: CPU seconds per answered image, by part.

Runs a closed loop of one-image uint8 requests from this process and, over a window after a ramp, reads the
CPU time of every thread of the server's processes (the supervisor and its descendants: /proc/PID/task/*/
schedstat, Linux's nanoseconds on a CPU, where stat's clock ticks would leave a light thread at zero) and of
this process. The parts: the forward team (the busiest threads of the busiest process, the engine: the
replica's worker and its OpenMP helpers, which also convert the raw images), the event loops (the main threads
of the other children, the front-ends), the server's other threads (gRPC, preprocessing, metrics, the engine's
sockets, the supervisor), and the client. Each is given in milliseconds per answered image and as a share of
what the machine had: cores x wall time. Whatever the client and the server's other threads take is not there
for the forward pass when they share the cores, which is how it is measured here.

Usage: python scripts/benchmarks/cpu_split.py --server 127.0.0.1:50151 --server-pid PID [--concurrency 16]
       [--image-size 224x224] [--ramp 3] [--window 15] [--team 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from resnet_client.api import classifier_pb2 as pb
from resnet_client.bench import make_image
from resnet_client.client import AsyncClient
from resnet_client.flags import image_size

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of each live thread of ``pid`` and of its descendants (the server's children are the fork
    server's), by (process, thread)."""
    seconds = {}
    for process in _descendants(pid):
        for task in Path(f"/proc/{process}/task").iterdir():
            try:
                seconds[(process, int(task.name))] = _thread_seconds(task)
            except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing (or as it was read)
                continue
    return seconds


def _thread_seconds(task: Path) -> float:
    """A thread's time on a CPU: schedstat's nanoseconds where the kernel keeps them, else stat's user and system
    clock ticks (a hundredth of a second: a front-end's loop may use only a few over a short window)."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        if not task.exists():
            raise
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_SECOND


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        below = [int(child) for child in children.read_text().split()]
    except (FileNotFoundError, ProcessLookupError):  # it ended since its parent listed it (or as it was read)
        return []
    return [pid, *(process for child in below for process in _descendants(child))]


def split(pid: int, before: dict[tuple[int, int], float], after: dict[tuple[int, int], float],
          team: int) -> dict[str, float]:
    """The server's CPU seconds over the window: the engine's ``team`` busiest threads, the other children's
    main threads (the front-ends' event loops), the rest."""
    used = {key: seconds - before.get(key, 0.0) for key, seconds in after.items()}
    by_process: dict[int, float] = {}
    for (process, _), seconds in used.items():
        by_process[process] = by_process.get(process, 0.0) + seconds
    engine = max((process for process in by_process if process != pid), key=by_process.get, default=pid)
    forward = sorted((seconds for (process, _), seconds in used.items() if process == engine), reverse=True)[:team]
    loops = sum(seconds for (process, thread), seconds in used.items()
                if process == thread and process not in (pid, engine))
    return {"forward_team": sum(forward), "event_loop": loops,
            "other_threads": sum(used.values()) - sum(forward) - loops}


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
