"""Turn the JSON written by scripts/bench_cpu.sh into the README's performance table and ratios."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from perf_analyzer import REQUEST_PARTS, part_label

from resnet_client.flags import DEFAULT_IMAGE_SIZE, size_text


def load(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.json").read_text().splitlines() if line.strip()]


def load_interleaved(folder: Path, name: str) -> tuple[dict, str] | None:
    """An interleaved run's result (scripts/benchmarks/latency_pairs.py or throughput_pairs.py) and the opening of its
    line, or None when the run did not record one."""
    if not (folder / f"{name}.json").exists():
        return None
    result = load(folder, name)[0]
    if "pairs" in result:  # scripts/benchmarks/perf_analyzer_pairs.py: perf_analyzer's three windows a side
        return result, f"Interleaved ({result['pairs']} pairs of 3 x {result['window_ms'] / 1000:g} s per side)"
    return result, f"Interleaved ({result['windows']} windows of {result['window_s']:g} s per side)"


def rounds_best_batch(folder: Path) -> int:
    """The batch size whose forward rate has the highest median over the alternating rounds' ceilings.

    Five measurements each, minutes apart, rather than the first ceiling's one: on the AMD EPYC VM the
    first ceiling put batch 16 (or, compiled, 32) ahead where the rounds put batch 8 ahead by 3-10%, and
    timing the interleaved pairs' in-process side at the slower size flattered the served ratio."""
    rates: dict[str, list[float]] = {}
    for ceiling in load(folder, "rounds_ceiling"):
        for size, rate in ceiling["forward_images_per_s"].items():
            rates.setdefault(size, []).append(rate)
    return int(max(rates, key=lambda size: statistics.median(rates[size])))


def main(folder: Path, size: str) -> None:
    uint8 = load(folder, "ceiling_uint8")[0]
    jpeg = load(folder, "ceiling_jpeg")[0]
    ceiling_uint8 = max(uint8["forward_images_per_s"].values())
    ceiling_uint8_pre = uint8["ceiling_with_preprocess_images_per_s"]
    ceiling_jpeg = jpeg["ceiling_with_preprocess_images_per_s"]
    batch1_ms = batch1_latency_ms(uint8)
    served = {name: {p["concurrency"]: p for p in load(folder, name)}
              for name in ("served_uint8", "served_jpeg", "served_uint8_nobatch")}
    graph = " with --compile" if uint8.get("compiled") else " with --torchscript" if uint8.get("torchscript") else ""
    flags_file = folder / "server_flags.txt"
    flags = flags_file.read_text().strip() if flags_file.exists() else ""
    served_with = f", server flags {flags}" if flags else ""
    print(f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} ({cpu_model()}, "
          f"device {uint8.get('device', 'cpu')}, {uint8.get('precision', 'fp32')}, "
          f"torch threads {uint8['torch_threads']}), "
          f"scripts/bench_cpu.sh{graph}{served_with}, {size} images, "
          "seeded random weights.\n")
    print("| what | images/s | p50 ms | p99 ms | mean batch | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for size, rate in uint8["forward_images_per_s"].items():
        print(f"| in-process forward, batch {size} | {rate:.1f} | | | | |")
    print(f"| in-process preprocess, uint8 | {uint8['preprocess_images_per_s']:.1f} | | | | |")
    print(f"| in-process ceiling with uint8 preprocess | {ceiling_uint8_pre:.1f} | | | | |")
    print(f"| in-process decode+preprocess, JPEG | {jpeg['preprocess_images_per_s']:.1f} | | | | |")
    print(f"| in-process ceiling with JPEG decode | {ceiling_jpeg:.1f} | | | | |")
    rows = [("served uint8, c=1", served["served_uint8"][1], None),
            ("served uint8, c=16", served["served_uint8"][16], ceiling_uint8),
            ("served JPEG, c=1", served["served_jpeg"][1], None),
            ("served JPEG, c=16", served["served_jpeg"][16], ceiling_jpeg),
            ("served uint8, c=16, --max-batch-size 1", served["served_uint8_nobatch"][16], ceiling_uint8)]
    for label, point, ceiling in rows:
        batch = mean_batch(point)
        ratio = f"{point['images_per_s'] / ceiling:.2f} x ceiling" if ceiling else ""
        if ceiling == ceiling_uint8:
            ratio += f" ({point['images_per_s'] / ceiling_uint8_pre:.2f} x with preprocess"
            if served_batch := nearest_batch(uint8["forward_images_per_s"], batch):
                ratio += (f"; {point['images_per_s'] / uint8['forward_images_per_s'][served_batch]:.2f} x the "
                          f"forward pass at batch {served_batch}, the batch served")
            ratio += ")"
        print(f"| {label} | {point['images_per_s']:.1f} | {point['p50_ms']:.1f} | {point['p99_ms']:.1f} | "
              f"{float('nan') if batch is None else batch:.2f} | {ratio} |")
    c1, c16 = served["served_uint8"][1], served["served_uint8"][16]
    print(f"\nc=1 p50 {c1['p50_ms']:.1f} ms vs in-process batch-1 latency (median) {batch1_ms:.1f} ms "
          f"({c1['p50_ms'] - batch1_ms:+.1f} ms); c=16 p99/p50 = {c16['p99_ms'] / c16['p50_ms']:.2f}; "
          f"batching on/off at c=16: {c16['images_per_s']:.1f} vs "
          f"{served['served_uint8_nobatch'][16]['images_per_s']:.1f} images/s")
    if spread := in_process_spread(uint8, c16):
        print(f"One in-process batch-{spread[0]} forward call on the same machine: p99/p50 = {spread[1]:.2f}")
    print_rounds(folder)
    print_throughput_pairs(folder)
    print_cpu_split(folder)
    print_perf_analyzer(folder, batch1_ms, max(uint8["forward_images_per_s"].values()))


def cpu_model() -> str:
    """The CPU's own name where Linux gives it (the project's VMs have changed under it: Intel with AMX, then
    AMD EPYC), else the architecture."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]}, {platform.machine()}" if names else platform.processor() or platform.machine()


def batch1_latency_ms(ceiling: dict) -> float:
    """The in-process batch-1 latency: the median call where bench-model recorded it (the same statistic
    as the served p50), else the mean (1 / throughput)."""
    return ceiling.get("batch1_latency_p50_ms") or 1000.0 / ceiling["forward_images_per_s"]["1"]


def mean_batch(point: dict) -> float | None:
    """The served mean batch size, averaged over the replicas the server reported."""
    sizes = [view["mean_batch_size"] for view in point["server"].values() if "mean_batch_size" in view]
    return statistics.mean(sizes) if sizes else None


def nearest_batch(measured: dict[str, object], served_batch: float | None) -> str | None:
    """Of the batch sizes measured in process, the one nearest a served point's mean batch (``mean_batch``);
    None where the server reported none."""
    if not measured or served_batch is None:
        return None
    return min(measured, key=lambda size: abs(int(size) - served_batch))


def in_process_spread(ceiling: dict, point: dict) -> tuple[str, float] | None:
    """p99/p50 of one in-process forward call at the measured batch size nearest the served mean batch
    (the spread this machine puts on a fixed amount of work, to set beside the served p99/p50), with that
    batch size; None where bench-model did not record calls."""
    calls = ceiling.get("forward_call_ms")
    size = nearest_batch(calls or {}, mean_batch(point))
    return None if size is None else (size, calls[size]["p99"] / calls[size]["p50"])


def print_rounds(folder: Path) -> None:
    """The headline figures, pair by pair, seconds apart: served uint8 c=16 over the forward ceiling, and
    served c=1 p50 latency over the in-process batch-1 latency."""
    if not (folder / "rounds_served.json").exists():
        return
    ceilings = load(folder, "rounds_ceiling")
    served = load(folder, "rounds_served")
    c16 = [point for point in served if point["concurrency"] == 16]
    c1 = [point for point in served if point["concurrency"] == 1]
    best = [max(ceiling["forward_images_per_s"].values()) for ceiling in ceilings]
    print("\n" + rate_pairs_line("served uint8 c=16 / in-process forward ceiling", c16, best))
    # The ceiling is the best batch size's; sixteen closed-loop callers may form smaller batches than that.
    sizes = [nearest_batch(ceiling["forward_images_per_s"], mean_batch(point))
             for point, ceiling in zip(c16, ceilings, strict=True)]
    if sizes and None not in sizes and len(set(sizes)) == 1:
        at_served = [ceiling["forward_images_per_s"][sizes[0]] for ceiling in ceilings]
        print(rate_pairs_line(f"served uint8 c=16 / in-process forward at batch {sizes[0]}, the batch served",
                              c16, at_served))
    print_jpeg_rounds(folder, ceilings)
    spreads = [(point["p99_ms"] / point["p50_ms"], in_process_spread(ceiling, point))
               for point, ceiling in zip(c16, ceilings, strict=True)]
    if all(in_process for _, in_process in spreads):
        pairs = ", ".join(f"{served:.2f}/{in_process[1]:.2f}" for served, in_process in spreads)
        print(f"Alternating rounds, p99/p50 of served uint8 c=16 / of one in-process batch-{spreads[0][1][0]} "
              f"forward call: {pairs}")
    if not c1:
        return
    batch1_ms = [batch1_latency_ms(ceiling) for ceiling in ceilings]
    gaps = [point["p50_ms"] - ms for point, ms in zip(c1, batch1_ms, strict=True)]
    pairs = ", ".join(f"{point['p50_ms']:.1f}/{ms:.1f}" for point, ms in zip(c1, batch1_ms, strict=True))
    print(f"Alternating rounds, served uint8 c=1 p50 / in-process batch-1 latency: {pairs} ms; "
          f"difference median {statistics.median(gaps):+.1f} ms (range {min(gaps):+.1f} to {max(gaps):+.1f})")
    if found := load_interleaved(folder, "latency_pairs"):
        interleaved, opening = found
        low, high = interleaved["difference_range_ms"]
        print(f"{opening}, served uint8 c=1 p50 / in-process batch-1 p50: {interleaved['served_p50_ms']:.1f} / "
              f"{interleaved['in_process_p50_ms']:.1f} ms; difference median "
              f"{interleaved['difference_median_ms']:+.1f} ms (range {low:+.1f} to {high:+.1f})")
        if "outside_compute_median_ms" in interleaved:
            print(f"Of which (medians per window): the server's batch time minus the in-process forward pass "
                  f"{interleaved['compute_minus_in_process_median_ms']:+.1f} ms, the request outside the "
                  f"server's batch {interleaved['outside_compute_median_ms']:.1f} ms; an empty gRPC call "
                  f"(GetModelInfo) round trip {interleaved['empty_call_p50_ms']:.1f} ms")


def print_jpeg_rounds(folder: Path, ceilings: list[dict]) -> None:
    """Served JPEG c=16 over the JPEG ceiling (the best forward pass in series with decode+preprocess), pair
    by pair; runs before 2026-11-22 11:36 UTC had no JPEG rounds."""
    if not (folder / "rounds_served_jpeg.json").exists():
        return
    best = [ceiling["ceiling_with_preprocess_images_per_s"] for ceiling in ceilings]
    print(rate_pairs_line("served JPEG c=16 / in-process ceiling with JPEG decode",
                          load(folder, "rounds_served_jpeg"), best))


def rate_pairs_line(what: str, served: list[dict], ceilings: list[float]) -> str:
    """One line for the rounds' served rates against the ceilings measured beside them: the pairs, then
    the median ratio and its range."""
    ratios = [point["images_per_s"] / ceiling for point, ceiling in zip(served, ceilings, strict=True)]
    pairs = ", ".join(f"{point['images_per_s']:.1f}/{ceiling:.1f}"
                      for point, ceiling in zip(served, ceilings, strict=True))
    return (f"Alternating rounds, {what}: {pairs} images/s; "
            f"ratio median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


def print_throughput_pairs(folder: Path) -> None:
    """Served c=16 over the in-process forward pass, interleaved window by window
    (scripts/benchmarks/throughput_pairs.py)."""
    if not (found := load_interleaved(folder, "throughput_pairs")):
        return
    pairs, opening = found
    low, high = pairs["ratio_range"]
    print(f"{opening}, served uint8 c={pairs['concurrency']} / in-process forward at batch {pairs['batch_size']}: "
          f"{pairs['served_images_per_s']:.1f} / {pairs['in_process_images_per_s']:.1f} images/s; "
          f"ratio median {pairs['ratio_median']:.2f} (range {low:.2f}-{high:.2f})")


def print_cpu_split(folder: Path) -> None:
    """Where the cores went while the server answered c=16 (scripts/benchmarks/cpu_split.py)."""
    if not (folder / "cpu_split.json").exists():
        return
    cpu = load(folder, "cpu_split")[0]
    parts = ", ".join(f"{part.replace('_', ' ')} {cpu['cpu_ms_per_image'][part]:.2f} ms "
                      f"({100 * share:.1f}%)" for part, share in cpu["share_of_cores"].items() if part != "unaccounted")
    print(f"CPU per served image at c={cpu['concurrency']} ({cpu['window_s']:.0f} s, {cpu['images_per_s']:.1f} "
          f"images/s; share of the {cpu['cores']} cores): {parts}; unaccounted "
          f"{100 * cpu['share_of_cores']['unaccounted']:.1f}%")
    # A bound on served images/s over the in-process forward ceiling: in process the forward team has every
    # core, a served image needs at least the same forward CPU, and served the team got only its share (the
    # event loop, the server's other threads, the client and what the split could not account for took the
    # rest). The raw images' conversion runs in that share too, so the real figure is lower still.
    print(f"Most that served c={cpu['concurrency']} can reach of the in-process forward ceiling on these cores: "
          f"{cpu['share_of_cores']['forward_team']:.3f} (the forward team's share; the rest went to serving and "
          "the client)")


def print_perf_analyzer(folder: Path, batch1_ms: float, ceiling: float) -> None:
    """Triton's perf_analyzer beside `resnet-client bench`, both sending FP32 (scripts/perf_analyzer.py)."""
    if not (folder / "perf_analyzer.json").exists():
        return
    ours = {point["concurrency"]: point for point in load(folder, "served_fp32")}
    for line in perf_analyzer_lines(load(folder, "perf_analyzer"), ours, batch1_ms, ceiling):
        print(line)
    if found := load_interleaved(folder, "perf_analyzer_pairs"):
        print(perf_analyzer_pairs_line(*found))


def perf_analyzer_pairs_line(pairs: dict, opening: str) -> str:
    """perf_analyzer's c=1 and c=16 against the in-process pass, interleaved
    (scripts/benchmarks/perf_analyzer_pairs.py)."""
    (low, high), (ratio_low, ratio_high) = pairs["c1_difference_range_ms"], pairs["ratio_range"]
    split = " + ".join(f"{part_label(name)} {ms:.2f}" for name, ms in pairs["c1_server_split_median_ms"].items())
    return (f"{opening}, Triton's perf_analyzer FP32 c=1 p50 / in-process batch-1 p50: "
            f"{pairs['c1_served_p50_ms']:.1f} / {pairs['c1_in_process_p50_ms']:.1f} ms; "
            f"difference median {pairs['c1_difference_median_ms']:+.1f} ms "
            f"(range {low:+.1f} to {high:+.1f}); the server's split of a c=1 request (medians of means, ms): {split}, "
            f"its forward pass less the in-process one {pairs['c1_infer_minus_in_process_median_ms']:+.2f}, "
            f"the round trip outside the server {pairs['c1_outside_server_median_ms']:.2f}; "
            f"c={pairs['concurrency']} / in-process forward at batch {pairs['batch_size']}: "
            f"{pairs['served_images_per_s']:.1f} / {pairs['in_process_images_per_s']:.1f} images/s; ratio median "
            f"{pairs['ratio_median']:.2f} (range {ratio_low:.2f}-{ratio_high:.2f})")


def perf_analyzer_lines(rows: list[dict], ours: dict[int, dict], batch1_ms: float, ceiling: float) -> list[str]:
    """One line per concurrency: perf_analyzer's figures, the server's split of a request, and ours beside them."""
    lines = []
    for row in rows:
        c, p50_ms = row["concurrency"], row["p50_us"] / 1000
        against = f"{p50_ms - batch1_ms:+.1f} ms over in-process batch 1" if c == 1 else \
            f"{row['throughput'] / ceiling:.2f} x the forward ceiling"
        split = " + ".join(f"{part_label(name)} {row[name] / 1000:.1f}" for name in REQUEST_PARTS)
        mine = ours.get(c)
        beside = (f"; resnet-client bench --input fp32: {mine['images_per_s']:.1f} images/s, "
                  f"p50 {mine['p50_ms']:.1f} ms" if mine else "")
        lines.append(f"Triton's perf_analyzer, FP32 c={c}: {row['throughput']:.1f} images/s, p50 {p50_ms:.1f} ms, "
                     f"p99 {row['p99_us'] / 1000:.1f} ms ({against}); the server's own split of a request "
                     f"(ModelStatistics): {split} = {row['request_us'] / 1000:.1f} ms{beside}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", nargs="?", type=Path, default=Path("results"),
                        help="what scripts/bench_cpu.sh wrote (default: results)")
    parser.add_argument("size", nargs="?", default=size_text(DEFAULT_IMAGE_SIZE),
                        help="the JPEG size it benched, WxH (default: %(default)s)")
    parser.add_argument("--rounds-best-batch", action="store_true",
                        help="print only the batch size its rounds ran fastest in process (bench_cpu.sh times its "
                             "c=16 pairs at it)")
    return parser


if __name__ == "__main__":
    args = build_parser().parse_args()
    if args.rounds_best_batch:
        print(rounds_best_batch(args.folder))
    else:
        main(args.folder, args.size)
