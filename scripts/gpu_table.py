"""Turn the JSON written by scripts/gpu_check.sh into the README's GPU table and the device issue's targets.

Usage: python scripts/gpu_table.py RESULTS FP32_BATCH FP16_BATCH  (the served batch caps gpu_check.sh names)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_table import load

PRECISIONS = ("fp32", "fp16", "bf16")


def results(folder: Path, name: str) -> list[dict]:
    """The JSON lines one step wrote; none when it did not run or failed before writing (an empty file)."""
    return load(folder, name) if (folder / f"{name}.json").exists() else []


def ceiling_rows(folder: Path) -> list[str]:
    rows = []
    compiled = (*(f"ceiling_fp16_compiled_{mode}" for mode in ("default", "reduce-overhead", "max-autotune")),
                "ceiling_fp32_compiled_reduce-overhead")
    torchscript = (f"ceiling_{p}_torchscript" for p in ("fp32", "fp16"))
    for name in (*(f"ceiling_{p}" for p in PRECISIONS), "ceiling_fp16_cuda_graphs", "ceiling_fp16_unfolded",
                 *compiled, *torchscript):
        for ceiling in results(folder, name)[:1]:
            for size, rate in ceiling["forward_images_per_s"].items():
                rows.append(f"| in-process forward, {ceiling_label(ceiling)}, batch {size} | {rate:.0f} "
                            "| | | | | | | |")
    return rows


def ceiling_label(ceiling: dict) -> str:
    """What ran: "fp16", "fp16 compiled, CUDA graphs", "fp16 TorchScript", "fp16 CUDA graphs", "fp16, batch norms
    not folded"."""
    compiled = {None: "", "default": " compiled", "reduce-overhead": " compiled, CUDA graphs",
                "max-autotune": " compiled max-autotune, CUDA graphs"}[ceiling["compile_mode"]]
    torchscript = " TorchScript" if ceiling.get("torchscript") else ""
    graphs = " CUDA graphs" if ceiling.get("cuda_graphs") else ""
    folded = "" if ceiling["fold_batch_norms"] else ", batch norms not folded"
    return ceiling["precision"] + compiled + torchscript + graphs + folded


def served_rows(folder: Path) -> list[str]:
    rows = []
    for name in ("served_batched", "served_16_per_request", "served_fp16", "served_fp16_connections16",
                 "served_fp16_frontends12", "served_fp16_torchscript", "served_fp16_cuda_graphs",
                 "served_fp16_cuda_graphs_stream", "served_fp16_cuda_graphs_16_per_request",
                 "served_fp16_cuda_graphs_connections16",
                 "served_fp16_cuda_graphs_frontends12",
                 "served_one_frontend", "served_nobatch",
                 "served_jpeg_decode_on_device_true", "served_jpeg_decode_on_device_false"):
        for point in results(folder, name):
            view = next(iter(point["server"].values()), {})
            errors = ", ".join(f"{code} {count}" for code, count in point["errors"].items())
            rows.append(f"| {name.replace('_', ' ')}, c={point['concurrency']} | {point['images_per_s']:.0f} | "
                        f"{point['p50_ms']:.1f} | {point['p99_ms']:.1f} | "
                        f"{view.get('mean_batch_size', float('nan')):.1f} | {batch_split(view)} | "
                        f"{point.get('client_cpu_cores', float('nan')):.1f} | {server_cores(point)} | {errors} |")
    return rows


def server_cores(point: dict) -> str:
    """The server's front-ends' and engines' CPU in cores (empty from a bench before it reported them)."""
    cores = point.get("server_cpu_cores")
    return f"{cores['frontends']:.1f} / {cores['engines']:.1f}" if cores else ""


def batch_split(view: dict) -> str:
    """A batch's mean input and infer ms (the engine's conversion and copy in, and its forward pass to the copy
    back): where a served batch's time goes; empty without the server's view."""
    if "mean_input_ms" not in view:
        return ""
    return f"{view['mean_input_ms']:.1f} / {view['mean_infer_ms']:.1f}"


# Each served run beside the in-process ceiling it is measured against (same device and precision).
SERVED_AGAINST_CEILING = (("served_batched", "ceiling_fp32"), ("served_one_frontend", "ceiling_fp32"),
                          ("served_16_per_request", "ceiling_fp32"), ("served_fp16", "ceiling_fp16"),
                          ("served_fp16_torchscript", "ceiling_fp16_torchscript"),
                          ("served_fp16_cuda_graphs", "ceiling_fp16_cuda_graphs"),
                          ("served_fp16_cuda_graphs_stream", "ceiling_fp16_cuda_graphs"),
                          ("served_fp16_cuda_graphs_16_per_request", "ceiling_fp16_cuda_graphs"))


def targets(folder: Path, fp32_batch: int, fp16_batch: int) -> list[str]:
    """The device issue's numbers: served uint8 at the highest concurrency (fp32, fp16, one front-end, sixteen
    images a call) against the in-process forward at the served maximum batch size (same device, precision,
    batch size), against batching off, and the front-end's cost against bare grpc.aio."""
    lines = served_against_ceilings(folder, fp32_batch, fp16_batch) + batching_on_off(folder)
    for run in ("served_fp16_cuda_graphs_perf_analyzer", "served_fp16_cuda_graphs_perf_analyzer_streaming"):
        lines += [perf_analyzer_line(point) for point in results(folder, run)]
    return lines + frontend_and_engine_cost(folder) + agreement(folder)


def top_point(folder: Path, served_name: str) -> dict | None:
    """A served run's highest-concurrency point, if it ran."""
    points = results(folder, served_name)
    return max(points, key=lambda point: point["concurrency"]) if points else None


def served_against_ceilings(folder: Path, fp32_batch: int, fp16_batch: int) -> list[str]:
    lines = []
    for served_name, ceiling_name in SERVED_AGAINST_CEILING:
        top, ceilings = top_point(folder, served_name), results(folder, ceiling_name)
        if not (top and ceilings):
            continue
        batch = fp32_batch if ceiling_name == "ceiling_fp32" else fp16_batch
        ceiling = ceilings[0]["forward_images_per_s"][str(batch)]
        rate = top["images_per_s"]
        lines.append(f"- {served_name} c={top['concurrency']}: {rate:.0f} images/s = "
                     f"{rate / ceiling:.2f} x the in-process {ceiling_name[8:].replace('_', ' ')} forward at batch "
                     f"{batch} ({ceiling:.0f}); target >= 0.8")
    return lines


def batching_on_off(folder: Path) -> list[str]:
    batched, unbatched_points = top_point(folder, "served_batched"), results(folder, "served_nobatch")
    if not (batched and unbatched_points):
        return []
    unbatched = unbatched_points[0]
    return [f"- batching on / off at c={batched['concurrency']}: {batched['images_per_s']:.0f} / "
            f"{unbatched['images_per_s']:.0f} images/s = "
            f"{batched['images_per_s'] / unbatched['images_per_s']:.1f} x; target >= 10"]


def frontend_and_engine_cost(folder: Path) -> list[str]:
    lines = []
    if cost := results(folder, "frontend_cost"):
        cpu = ", ".join(f"{name} {us:.0f} us" for name, us in cost[0]["cpu_us_per_call"].items())
        lines.append(f"- one front-end with a free model: {cost[0]['frontend_calls_per_s']:.0f} calls/s = "
                     f"{cost[0]['ratio']:.2f} x bare grpc.aio ({cost[0]['bare_calls_per_s']:.0f}); "
                     f"CPU a call: {cpu} = {cost[0]['cpu_ratio']:.2f} x bare; "
                     f"target <= {cost[0]['cpu_ratio_target']}")
    if ceiling := results(folder, "engine_ceiling"):
        engine = ceiling[0]
        lines.append(f"- one engine's own ceiling (free model, scores {engine['compute_ms']:g} ms after launch, "
                     f"{engine['feeders']} feeders x {engine['in_flight']} in flight): {engine['images_per_s']:.0f} "
                     f"images/s at {engine['engine_cpu_us_per_image']:.1f} us of its CPU an image, mean batch "
                     f"{engine['mean_batch']:.1f}")
    return lines


def agreement(folder: Path) -> list[str]:
    """How far fp16, bf16 and the GPU's JPEG decode move the answers."""
    lines = []
    if (folder / "precision.json").exists():
        precision = json.loads((folder / "precision.json").read_text())
        for name in ("fp16", "bf16"):
            lines.append(f"- {name}: top-1 agrees with fp32 on {100 * precision[name]['top1_agreement']:.2f}% of "
                         f"{precision['images']} images, max probability difference "
                         f"{precision[name]['max_probability_difference']:.1e}; target >= 99%")
    if (folder / "decode.json").exists():
        decode = json.loads((folder / "decode.json").read_text())
        lines.append(f"- GPU vs CPU JPEG decode: top-1 agrees on {100 * decode['top1_agreement']:.2f}% of "
                     f"{decode['images']} images, max probability difference "
                     f"{decode['max_probability_difference']:.1e}")
    return lines


def perf_analyzer_line(point: dict) -> str:
    """One perf_analyzer.py point: what it sent and how, what it measured, the server's split, its own CPU."""
    calls = "ModelStreamInfer messages" if point.get("streaming") else "ModelInfer calls"
    cores = f"; perf_analyzer's CPU {point['client_cores']:.1f} cores" if "client_cores" in point else ""
    return (f"- served fp16 CUDA graphs under perf_analyzer (C++, {point.get('input', 'fp32').upper()} requests as "
            f"{calls}) c={point['concurrency']}: {point['throughput']:.0f} images/s, p50 {point['p50_us'] / 1000:.1f} "
            f"ms, p99 {point['p99_us'] / 1000:.1f} ms; the server's own split of a request: queue "
            f"{point['queue_us'] / 1000:.1f} ms, compute {point['compute_infer_us'] / 1000:.1f} ms{cores}")


def compile_start_line(folder: Path) -> list[str]:
    """gpu_check.sh's compile_start part: time to SERVING with --compile, the cache cold and then warm."""
    start = results(folder, "compile_start")
    if not start:
        return []
    point = start[-1]
    return [f"Time to SERVING with --compile --compile-mode reduce-overhead --precision fp16 (buckets up to "
            f"{point['max_batch_size']}): {point['cold_s']:.0f} s with an empty --compile-cache, "
            f"{point['warm_s']:.0f} s from the cache the first start filled.", ""]


def main(folder: Path, fp32_batch: int, fp16_batch: int) -> None:
    device = (folder / "nvidia-smi.txt").read_text().splitlines() if (folder / "nvidia-smi.txt").exists() else []
    # The name from the device row of nvidia-smi's table: "|   0  NVIDIA H100 80GB HBM3   On  |   ...".
    rows = (line.split("|")[1].split() for line in device if "NVIDIA" in line and "Driver" not in line)
    gpu = next((" ".join(cells[1:-1]) for cells in rows if len(cells) > 2), "GPU")
    print(f"Measured {time.strftime('%Y-%m-%d')} with scripts/gpu_check.sh on {gpu}; uint8 224x224 unless "
          "named, seeded random weights.\n")
    print("| what | images/s | p50 ms | p99 ms | mean batch | batch input / infer ms | client cores "
          "| server cores: front-ends / engines | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(ceiling_rows(folder) + served_rows(folder)))
    print()
    print("\n".join(compile_start_line(folder)))
    print("\n".join(targets(folder, fp32_batch, fp16_batch)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("folder", type=Path, help="what scripts/gpu_check.sh wrote")
    parser.add_argument("fp32_batch", type=int, help="the fp32 server's --max-batch-size (gpu_check.sh names it)")
    parser.add_argument("fp16_batch", type=int, help="the fp16 server's --max-batch-size")
    return parser


if __name__ == "__main__":
    args = build_parser().parse_args()
    main(args.folder, args.fp32_batch, args.fp16_batch)
