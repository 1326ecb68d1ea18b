"""Served c=16 throughput against the in-process forward ceiling, interleaved window by window.

The rounds of scripts/bench_cpu.sh pair the two a minute apart, and this VM's speed moves by 10-40%
in that time: their ratios span 0.66-1.07 in one run. One process here alternates short windows
instead: the in-process forward pass at one batch size (the replica layout bench-model times,
the server idle), then a closed loop of uint8 requests to the server (the request bench sends, the
in-process side idle). Prints the median of each side and of the per-window ratios.

A served window counts the images answered between two answers, the last one before the pipeline
has filled and the last one before the window closes: in a closed loop the answers come in bursts, one
per batch, and ending both counts on a burst keeps a part-burst from moving the rate by up to a
batch's worth.

Usage: python scripts/benchmarks/throughput_pairs.py --server 127.0.0.1:50151 [--concurrency 16] [--batch-size 8]
       [--image-size 224x224] [--windows 15] [--window 4] [--device cpu] [--torch-threads 0] [--compile]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import statistics
import time

import torch

from resnet_client.api import classifier_pb2 as pb
from resnet_client.bench import make_image
from resnet_client.client import AsyncClient
from resnet_client.flags import image_size
from resnet_server.common.preprocess import RawImage, preprocess
from resnet_server.engine.bench_model import MAX_PIXELS, Replicas, add_model_arguments, parse_model_arguments


async def closed_loop(stub, request: pb.ClassifyRequest, concurrency: int, stop_at: float) -> list[float]:
    """When each answer of a closed loop of ``concurrency`` one-image requests came, until ``stop_at``, in order."""
    answered: list[float] = []

    async def caller() -> None:
        while time.perf_counter() < stop_at:
            await stub.Classify(request, timeout=60)
            answered.append(time.perf_counter())

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return sorted(answered)


async def served_window(stub, request: pb.ClassifyRequest, concurrency: int, ramp: float, seconds: float) -> float:
    """Images/s of a closed loop of ``concurrency`` one-image requests, after ``ramp`` seconds of filling."""
    started = time.perf_counter()
    count_from, stop_at = started + ramp, started + ramp + seconds
    answered = await closed_loop(stub, request, concurrency, stop_at)
    # The last answer before counting starts, or the first answer when the ramp ended before any came (a slow
    # first batch): either way the count starts on a burst.
    first = max(bisect.bisect_left(answered, count_from) - 1, 0)
    last = bisect.bisect_left(answered, stop_at) - 1  # the last answer before the window closes
    if last <= first:
        raise RuntimeError(f"window too short: {len(answered)} answers, too few of them inside {ramp + seconds} s")
    return (last - first) / (answered[last] - answered[first])


async def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    with Replicas(args, [args.batch_size]) as replicas:
        image = make_image("uint8", *args.image_size)
        request = pb.ClassifyRequest(images=[image])
        model_input = preprocess(RawImage("uint8", tuple(image.raw.shape), image.raw.data), MAX_PIXELS)
        pairs = []
        async with AsyncClient(args.server) as client:
            stub = client._stub  # the prepared message as is, as resnet-client bench sends it
            # A warm-up, however few it answers (on a busy machine, a batch or two).
            await closed_loop(stub, request, args.concurrency, time.perf_counter() + args.ramp + 1.0)
            for _ in range(args.windows):
                local, _ = replicas.rate(model_input, args.batch_size, args.window)
                served = await served_window(stub, request, args.concurrency, args.ramp, args.window)
                pairs.append((local, served))
    ratios = [served / local for local, served in pairs]
    return {"windows": args.windows, "window_s": args.window, "concurrency": args.concurrency,
            "batch_size": args.batch_size, "device": ",".join(str(runner.device) for runner in replicas.runners),
            "torch_threads": replicas.threads, "image_size": list(args.image_size),
            "in_process_images_per_s": statistics.median(local for local, _ in pairs),
            "served_images_per_s": statistics.median(served for _, served in pairs),
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "pairs_images_per_s": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="host:port of a server with --weights random, same layout")
    add_model_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="in-process batch (scripts/bench_cpu.sh passes the rounds' best batch size)")
    parser.add_argument("--image-size", type=image_size, default=(224, 224))
    parser.add_argument("--windows", type=int, default=15)
    parser.add_argument("--window", type=float, default=4.0, help="seconds per side per window")
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds a served window fills before counting")
    args = parse_model_arguments(parser)
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
