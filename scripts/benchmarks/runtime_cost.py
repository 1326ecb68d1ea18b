"""What each runtime and precision does on this CPU, in process and served: PyTorch fp32 and bf16, ONNX Runtime fp32
and int8 (on the CPU provider, and on OpenVINO's too where the onnxruntime-openvino build is installed).

In process: ``resnet-server bench-model`` (the same runner the engine builds, no gRPC) times the forward pass at
``--batch`` for ``--duration`` seconds. Served: a ``resnet-server --frontends 1 --device cpu`` a setting on
127.0.0.1, loaded by ``resnet-client bench --input uint8 --image-size 224x224`` at ``--concurrency`` for
``--duration`` seconds. Seeded random weights; the int8 setting serves a model ``resnet-server quantize`` makes first
from the same weights, calibrated on ``--calibration-images`` random JPEGs (speed does not depend on what the images
show). Each round measures every setting once in process and once served, in an order that rotates (a shared VM
drifts from one minute to the next; a drift then falls on every setting alike). Reported per setting: the medians
of the rounds' images/s in process and served, each against PyTorch fp32's, the served p50, and served against its
own in-process rate. The servers are stopped (SIGTERM, by PID) when done.

Usage: python scripts/benchmarks/runtime_cost.py [--concurrency 16] [--duration 10] [--rounds 3] [--batch 8]
       [--settings "torch fp32" "onnxruntime int8" ...] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
from served import ServedProcess, in_rotating_rounds, serving

BASE_PORT = 50201


def quantized_model(folder: Path, images: int) -> Path:
    """An int8 model of the seeded random weights, calibrated on random JPEGs written into ``folder``."""
    calibration = folder / "calibration"
    calibration.mkdir()
    generator = np.random.default_rng(0)
    for index in range(images):
        buffer = io.BytesIO()
        Image.fromarray(generator.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(buffer, "JPEG")
        (calibration / f"{index:04d}.jpg").write_bytes(buffer.getvalue())
    out = folder / "resnet18.int8.onnx"
    subprocess.run([sys.executable, "-m", "resnet_server", "quantize", "--weights", "random", "--calibration",
                    str(calibration), "--out", str(out), "--min-agreement", "0"], check=True, capture_output=True,
                   timeout=900)
    return out


def measure(server: ServedProcess, concurrency: int, duration: float) -> tuple[float, float]:
    """images/s and p50 milliseconds over one bench window."""
    point = server.bench(duration, "--input", "uint8", "--image-size", "224x224", "--concurrency", str(concurrency))
    return point["images_per_s"], point["p50_ms"]


def in_process(flags: list[str], batch: int, duration: float) -> float:
    """The forward pass's images/s at ``batch``, timed by resnet-server bench-model with the server's ``flags``."""
    done = subprocess.run([sys.executable, "-m", "resnet_server", "bench-model", *flags, "--batch-sizes", str(batch),
                           "--duration", str(duration), "--json"], check=True, capture_output=True, text=True,
                          timeout=duration * 4 + 600)
    return json.loads(done.stdout)["forward_images_per_s"][str(batch)]


def settings_for(int8: Path, cache: str) -> dict[str, list[str]]:
    """Each setting's flags, as resnet-server and bench-model both take them; OpenVINO's where this Python's ONNX
    Runtime is the onnxruntime-openvino build."""
    import onnxruntime

    onnx = {"fp32": ["--runtime", "onnxruntime", "--compile-cache", cache],
            "int8": ["--runtime", "onnxruntime", "--precision", "int8", "--weights", str(int8)]}
    providers = ["cpu"] + (["openvino"] if "OpenVINOExecutionProvider" in onnxruntime.get_available_providers() else [])
    settings = {"torch fp32": [], "torch bf16": ["--precision", "bf16"]}
    for provider in providers:
        for precision, flags in onnx.items():
            name = f"onnxruntime {precision}" + ("" if provider == "cpu" else f" {provider}")
            settings[name] = [*flags, "--onnx-provider", provider]
    return settings


def summary(measured: dict[str, list[tuple[float, float, float]]]) -> dict[str, dict]:
    """Medians of the rounds' (in-process rate, served rate, served p50), set against the first setting's."""
    def median(points: list[tuple[float, float, float]], index: int) -> float:
        return statistics.median(point[index] for point in points)

    first = next(iter(measured.values()))
    base_in_process, base_served = median(first, 0), median(first, 1)
    return {name: {"in_process_images_per_s": median(points, 0),
                   "in_process_ratio": median(points, 0) / base_in_process,
                   "images_per_s": median(points, 1), "ratio_to_torch": median(points, 1) / base_served,
                   "p50_ms": median(points, 2), "served_of_in_process": median(points, 1) / median(points, 0),
                   "rounds": [round(point[1], 1) for point in points]}
            for name, points in measured.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight (default 16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each setting once a round (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="the in-process batch size (default 8: the CPU's)")
    parser.add_argument("--settings", nargs="+", default=None,
                        help="the settings to measure, the first the one set against (default: all four)")
    parser.add_argument("--calibration-images", type=int, default=40,
                        help="random JPEGs the int8 model is calibrated on (default 40)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        every = settings_for(Path(folder) / "resnet18.int8.onnx", folder)
        chosen = args.settings or list(every)
        if unknown := [name for name in chosen if name not in every]:
            parser.error(f"unknown settings {unknown}; choose from {list(every)}")
        settings = {name: every[name] for name in chosen}
        if any(name.startswith("onnxruntime int8") for name in settings):
            quantized_model(Path(folder), args.calibration_images)
        setting_flags = {BASE_PORT + index: flags for index, flags in enumerate(settings.values())}
        with serving({port: ["--metrics-port", "0", *flags] for port, flags in setting_flags.items()}) as by_port:
            servers = dict(zip(settings, by_port.values(), strict=True))

            def both(server: ServedProcess) -> tuple[float, float, float]:
                rate = in_process(setting_flags[server.port], args.batch, args.duration)
                return (rate, *measure(server, args.concurrency, args.duration))

            results = summary(in_rotating_rounds(servers, args.rounds, both))
    if args.json:
        print(json.dumps(results))
    else:
        for name, row in results.items():
            print(f"{name:>17}  in process {row['in_process_images_per_s']:7.1f} images/s "
                  f"x{row['in_process_ratio']:.2f}  served {row['images_per_s']:7.1f} x{row['ratio_to_torch']:.2f} "
                  f"(p50 {row['p50_ms']:.1f} ms; x{row['served_of_in_process']:.2f} of in process)  "
                  f"rounds {row['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
