"""Triton's perf_analyzer against the in-process forward pass, interleaved window by window.

The benchmark issue's targets with an independent C++ client, measured as scripts/benchmarks/latency_pairs.py and
throughput_pairs.py measure them with ours (this VM's speed drifts 10-40% over minutes, so only sides
seconds apart compare). Each pair: in-process batch-1 passes, then perf_analyzer at c=1 (three windows);
the in-process forward pass at --batch-size, then perf_analyzer at c=16. Each side idles while the other
runs. The in-process side gets a ready FP32 tensor; perf_analyzer sends FP32 zeros, which the server
converts into the model's layout with the batch (the server's "input" time). Prints the medians of each
side, of the per-pair differences (c=1) and ratios (c=16), and the server's own split of a c=1 request
(ModelStatistics, as perf_analyzer reads it). That split is of means (ModelStatistics sums times), so
the c=1 pairs also keep the means of both sides: the served mean less the server's request time is the
round trip outside the server, and the server's forward pass less the in-process one what serving costs
the pass itself.

Usage: python scripts/benchmarks/perf_analyzer_pairs.py --server 127.0.0.1:50151 [--pairs 8] [--batch-size 8]
       [--window-ms 1500] [--window-requests 0] [--device cpu] [--torch-threads 0] [--compile] (the server's own
       model flags)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # the perf_analyzer driver is a tool of scripts/
import perf_analyzer  # noqa: E402

from resnet_server.common.shapes import FLOAT_SHAPE
from resnet_server.engine.bench_model import Replicas, add_model_arguments, parse_model_arguments


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    window_s = 3 * args.window_ms / 1000  # as long as perf_analyzer's three windows
    # Windows of a count of requests, where asked: on a loaded machine a time window can hold none.
    windows = {"window_requests": args.window_requests} if args.window_requests else {"window_ms": args.window_ms}
    latency, means, throughput, splits = [], [], [], []
    with Replicas(args, [1, args.batch_size]) as replicas:
        model_input = torch.zeros(FLOAT_SHAPE)
        perf_analyzer.run(args.server, 1, first_windows=True, **windows)  # warm-up
        for _ in range(args.pairs):
            _, calls = replicas.rate(model_input, 1, window_s)
            served = perf_analyzer.run(args.server, 1, first_windows=True, **windows)
            latency.append((1000 * statistics.median(calls), served["p50_us"] / 1000))
            means.append((1000 * statistics.fmean(calls), served["avg_us"] / 1000))
            splits.append(served)
            local, _ = replicas.rate(model_input, args.batch_size, window_s)
            served = perf_analyzer.run(args.server, args.concurrency, first_windows=True, **windows)
            throughput.append((local, served["throughput"]))
    differences = [served - local for local, served in latency]
    ratios = [served / local for local, served in throughput]
    return {"pairs": args.pairs, "window_ms": args.window_ms, "batch_size": args.batch_size,
            "concurrency": args.concurrency, "torch_threads": replicas.threads,
            "c1_in_process_p50_ms": statistics.median(local for local, _ in latency),
            "c1_served_p50_ms": statistics.median(served for _, served in latency),
            "c1_difference_median_ms": statistics.median(differences),
            "c1_difference_range_ms": [min(differences), max(differences)],
            "c1_server_split_median_ms": {name.removesuffix("_us"): statistics.median(s[name] for s in splits) / 1000
                                          for name in perf_analyzer.REQUEST_PARTS},
            # Medians over the pairs of each pair's means.
            "c1_outside_server_median_ms": statistics.median(
                served - split["request_us"] / 1000 for (_, served), split in zip(means, splits, strict=True)),
            "c1_infer_minus_in_process_median_ms": statistics.median(
                split["compute_infer_us"] / 1000 - local for (local, _), split in zip(means, splits, strict=True)),
            "in_process_images_per_s": statistics.median(local for local, _ in throughput),
            "served_images_per_s": statistics.median(served for _, served in throughput),
            "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "pairs_ms": latency, "pairs_mean_ms": means, "pairs_images_per_s": throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="host:port of a server with --weights random, same layout")
    add_model_arguments(parser)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="in-process batch for the c=16 pairs")
    parser.add_argument("--window-ms", type=int, default=1500, help="perf_analyzer's measurement window")
    parser.add_argument("--window-requests", type=int, default=0,
                        help="perf_analyzer's windows a count of requests each instead (the in-process side's stay "
                             "three --window-ms long)")
    args = parse_model_arguments(parser)
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
