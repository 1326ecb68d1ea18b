"""What each runtime serves on this CPU: the same server with PyTorch fp32, ONNX Runtime fp32 and ONNX Runtime int8.

Three ``resnet-server --frontends 1 --device cpu`` on 127.0.0.1 (seeded random weights; the int8 one serves a model
``resnet-server quantize`` makes first from the same weights, calibrated on ``--calibration-images`` random JPEGs:
speed does not depend on what the images show). Each is loaded in turn by ``resnet-client bench --input uint8
--image-size 224x224`` at ``--concurrency`` for ``--duration`` seconds, in ``--rounds`` rounds whose order rotates
(a shared VM drifts from one minute to the next; a drift then falls on all three alike). Reported per runtime: the
median of the rounds' images/s and p50 latency, and the images/s against PyTorch's. The servers are stopped
(SIGTERM, by PID) when done.

Usage: python scripts/benchmarks/runtime_cost.py [--concurrency 16] [--duration 10] [--rounds 3] [--json]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight (default 16)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each runtime once a round (default 3)")
    parser.add_argument("--calibration-images", type=int, default=40,
                        help="random JPEGs the int8 model is calibrated on (default 40)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        int8 = quantized_model(Path(folder), args.calibration_images)
        settings = {"torch fp32": [], "onnxruntime fp32": ["--runtime", "onnxruntime", "--compile-cache", folder],
                    "onnxruntime int8": ["--runtime", "onnxruntime", "--precision", "int8", "--weights", str(int8)]}
        flags_by_port = {BASE_PORT + index: ["--metrics-port", "0", *flags]
                         for index, flags in enumerate(settings.values())}
        with serving(flags_by_port) as by_port:
            measured = in_rotating_rounds(dict(zip(settings, by_port.values(), strict=True)), args.rounds,
                                          lambda server: measure(server, args.concurrency, args.duration))
    torch_rate = statistics.median(rate for rate, _ in measured["torch fp32"])
    results = {name: {"images_per_s": statistics.median(rate for rate, _ in points),
                      "ratio_to_torch": statistics.median(rate for rate, _ in points) / torch_rate,
                      "p50_ms": statistics.median(p50 for _, p50 in points),
                      "rounds": [round(rate, 1) for rate, _ in points]}
               for name, points in measured.items()}
    if args.json:
        print(json.dumps(results))
    else:
        for name, row in results.items():
            print(f"{name:>17}  {row['images_per_s']:8.1f} images/s  x{row['ratio_to_torch']:.2f}  "
                  f"p50 {row['p50_ms']:.1f} ms  rounds {row['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
