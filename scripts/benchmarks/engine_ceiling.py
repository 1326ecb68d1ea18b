"""The engine's own ceiling: how many images a second one engine process hands through, and its CPU an image.

A GPU engine is one process, and its threads share one GIL, so its CPU time an image bounds what one device can
serve however many front-ends feed it (frontend_cost.py's engine figure is for batches of one or two calls; a GPU's
batches are far larger). This starts one engine as the server does, with the free runner (``--runner free``: ready-made
inputs and scores; with ``--compute-ms`` each batch's scores land that long after its launch, as a GPU's do, so
batches grow as they do on a device), and feeds it from ``--feeders`` processes that do what a front-end does after
gRPC: the real ``EngineClient`` (a slot each image, the pixels into the slab, one message a loop turn, the answers
read back), ``--in-flight`` images each, one image a call. No gRPC and no client: what is left is the engine and the
hand-off. It prints images a second, the engine's CPU microseconds an image (every thread of the process, over the
measured window) and the mean batch.

Usage: python scripts/benchmarks/engine_ceiling.py [--feeders 2] [--in-flight 64] [--compute-ms 4] [--duration 10]
       [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from dataclasses import replace

from frontend_cost import cpu_seconds  # its folder is the first path entry, and its spawned children's

RAW_BYTES = 224 * 224 * 3


def feed(link, owner: int, in_flight: int, pipe) -> None:
    """One feeder process: connects, says so, and keeps ``in_flight`` images in flight through an EngineClient
    from the (start, end) it is sent (time.monotonic(), one clock for every process) until end; sends back how
    many were answered in that window."""
    from resnet_server.common.preprocess import RawImage
    from resnet_server.common.work import WorkItem
    from resnet_server.frontend.engine_client import EngineClient

    async def main() -> int:
        loop = asyncio.get_running_loop()
        client = EngineClient(link, owner, on_lost=lambda: None, on_back=lambda: None)
        await client.open()
        pipe.send("connected")
        start, end = await loop.run_in_executor(None, pipe.recv)
        image = RawImage("uint8", (224, 224, 3), bytes(RAW_BYTES))
        counted = 0

        async def caller() -> None:
            nonlocal counted
            while time.monotonic() < end:
                item = WorkItem(image, 1.0, 1, None, loop.create_future())
                client.submit([item])
                await item.caller
                counted += start <= time.monotonic() < end

        await asyncio.gather(*(caller() for _ in range(in_flight)))
        client.stop()
        return counted

    pipe.send(asyncio.run(main()))


def batch_totals(port: int) -> tuple[float, float]:
    """The engine's resnet_batch_size (sum, count) from its /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("resnet_batch_size_sum", "resnet_batch_size_count"))}
    return values["resnet_batch_size_sum"], values["resnet_batch_size_count"]


def one_round(supervisor, args: argparse.Namespace) -> dict:
    context = multiprocessing.get_context("spawn")
    engine = {"engine": supervisor.children["engine-0"].process.pid}
    port = supervisor.children["engine-0"].metrics_port
    pipes = []
    for number in range(args.feeders):
        ours, theirs = context.Pipe()
        context.Process(target=feed, args=(supervisor.links[0], 5000 + number, args.in_flight, theirs)).start()
        pipes.append(ours)
    for pipe in pipes:
        pipe.recv()  # every feeder connected
    start = time.monotonic() + 1.0  # a second of warm-up
    end = start + args.duration
    for pipe in pipes:
        pipe.send((start, end))
    time.sleep(max(0.0, start - time.monotonic()))
    cpu, batches = cpu_seconds(engine)["engine"], batch_totals(port)
    time.sleep(max(0.0, end - time.monotonic()))
    cpu = cpu_seconds(engine)["engine"] - cpu
    batches = [after - before for before, after in zip(batches, batch_totals(port), strict=True)]
    images = sum(pipe.recv() for pipe in pipes)
    return {"images_per_s": images / args.duration, "engine_cpu_us_per_image": 1e6 * cpu / images,
            "mean_batch": batches[0] / batches[1] if batches[1] else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--feeders", type=int, default=2, help="feeder processes (front-ends without gRPC)")
    parser.add_argument("--in-flight", type=int, default=64, help="images in flight per feeder")
    parser.add_argument("--compute-ms", type=float, default=4.0, help="each batch's scores land this long after launch")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds a round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--metrics-port", type=int, default=50170,
                        help="the engine's /metrics is on the port two after it (its mean batch is read there)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a line of text")
    args = parser.parse_args()

    from resnet_server.common.config import ServerConfig
    from resnet_server.common.devices import resolve_devices
    from resnet_server.supervisor.launcher import Supervisor

    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=args.metrics_port, devices=("cpu",),
                          weights="random", max_batch_size=args.max_batch_size, runner=f"free:{args.compute_ms:g}",
                          max_queue=max(1024, args.feeders * args.in_flight))
    supervisor = Supervisor(replace(config, frontends=1), resolve_devices(config.devices))
    try:
        if supervisor.start_engines() is not None:
            raise SystemExit("the engine ended before it was ready")
        rounds = [one_round(supervisor, args) for _ in range(args.rounds)]
    finally:
        supervisor.stop()
        supervisor.close()
    result = {key: statistics.median(measured[key] for measured in rounds) for key in rounds[0]}
    result.update(feeders=args.feeders, in_flight=args.in_flight, compute_ms=args.compute_ms, rounds=args.rounds)
    print(json.dumps(result) if args.json else
          f"one engine: {result['images_per_s']:.0f} images/s, {result['engine_cpu_us_per_image']:.1f} us of its CPU "
          f"an image, mean batch {result['mean_batch']:.1f} ({args.feeders} feeders x {args.in_flight} in flight, "
          f"scores {args.compute_ms:g} ms after launch)")


if __name__ == "__main__":
    main()
