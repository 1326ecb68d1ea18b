"""This server against LitServe on the same runtime: both serve the same int8 ONNX model with ONNX Runtime, batches of
up to 8 images, side by side on this CPU, loaded by the same HTTP client.

The model: ``resnet-server quantize`` of seeded random weights, calibrated on ``--calibration-images`` random JPEGs
(speed does not depend on what the images show). LitServe (``litserve`` importable by ``--litserve-python``, by
default this Python) runs a LitAPI this script defines: each request's base64 raw uint8 224x224 image resized and
cropped as this server preprocesses it (shorter side to 256, centre 224, ImageNet's mean and std), batched up to 8
with a 5 ms ``batch_timeout``, one InferenceSession with every core's threads, softmax in float64, the top 5 in
JSON. This server: ``resnet-server --runtime onnxruntime --precision int8`` with ``--http-port``, asked
``POST /v1/classify`` with the same image (the own API's JSON: the raw tensor in base64, top 5). The client:
``--processes`` processes of aiohttp, ``--concurrency`` calls in flight each, for ``--duration`` seconds a window;
rounds rotate the two servers' order; while one is measured the other's processes are stopped (SIGSTOP), and each
round also times the model in process with both stopped (``resnet-server bench-model``,
batch 8: the ceiling both serve under). Reported: each server's images/s and p50 (medians of the rounds), against
LitServe's and against the ceiling; with ``--grpc``, ours also through ``resnet-client bench`` (gRPC, raw uint8).
Both servers are stopped (SIGTERM to their process groups, by PID) when done.

Usage: python scripts/benchmarks/litserve_pairs.py [--litserve-python PY] [--concurrency 8] [--processes 2]
       [--duration 10] [--rounds 3] [--grpc] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

BASE_PORT = 50501
BATCH, BATCH_TIMEOUT_S = 8, 0.005
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


def preprocessed(pixels: np.ndarray) -> np.ndarray:
    """An HxWx3 uint8 image as this server preprocesses it: float32 [3, 224, 224]."""
    from PIL import Image

    image = Image.fromarray(pixels)
    scale = 256 / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
    left, top = (image.width - 224) // 2, (image.height - 224) // 2
    cropped = np.asarray(image.crop((left, top, left + 224, top + 224)), np.float32) / 255
    return ((cropped - MEAN) / STD).transpose(2, 0, 1)


try:  # only LitServe's side, run by --litserve-python, has litserve; its workers import this module
    import litserve
except ImportError:
    litserve = None
else:
    class ResNetInt8(litserve.LitAPI):
        """The int8 model on ONNX Runtime: base64 raw images in, the top 5 classes out."""

        def __init__(self, model: str, **batching) -> None:
            super().__init__(**batching)
            self.model = model

        def setup(self, device: str) -> None:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = len(os.sched_getaffinity(0))
            self.session = onnxruntime.InferenceSession(self.model, options, providers=["CPUExecutionProvider"])

        def decode_request(self, request: dict) -> np.ndarray:
            pixels = np.frombuffer(base64.b64decode(request["data"]), np.uint8)
            return preprocessed(pixels.reshape(int(request["height"]), int(request["width"]), 3))

        def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
            return np.stack(inputs)

        def predict(self, batch: np.ndarray) -> np.ndarray:
            (logits,) = self.session.run(None, {"input": batch})
            shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
            exponentials = np.exp(shifted)
            return exponentials / exponentials.sum(axis=1, keepdims=True)

        def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
            return list(output)

        def encode_response(self, probabilities: np.ndarray) -> dict:
            top = np.argsort(probabilities)[::-1][:5]
            return {"top_k": [{"index": int(index), "probability": float(probabilities[index])} for index in top]}


def serve_litserve(model: str, port: int) -> None:
    """LitServe's side (needs litserve, onnxruntime, numpy and pillow only)."""
    if litserve is None:
        raise SystemExit("litserve is not installed in this Python")
    api = ResNetInt8(model, max_batch_size=BATCH, batch_timeout=BATCH_TIMEOUT_S)
    litserve.LitServer(api, accelerator="cpu", workers_per_device=1).run(host="127.0.0.1", port=port,
                                                                              generate_client_file=False)


def request_bodies(seed: int = 0) -> dict[str, bytes]:
    """The same 224x224 uint8 image as each server's JSON request."""
    pixels = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    data = base64.b64encode(pixels.tobytes()).decode()
    return {"litserve": json.dumps({"data": data, "height": 224, "width": 224}).encode(),
            "ours": json.dumps({"images": [{"raw": {"dtype": "UINT8", "shape": [224, 224, 3], "data": data}}],
                                "top_k": 5}).encode()}


def load(url: str, body: bytes, concurrency: int, duration: float, warmup: float) -> list[float]:
    """One load process: ``concurrency`` closed loops of POSTs; the seconds of each call answered 200 in the window
    (a call that fails ends the process with its status)."""
    import aiohttp

    async def run() -> list[float]:
        latencies: list[float] = []
        start = time.monotonic()
        opens, closes = start + warmup, start + warmup + duration
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def loop() -> None:
                while (sent := time.monotonic()) < closes:
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as reply:
                        await reply.read()
                        if reply.status != 200:
                            raise SystemExit(f"{url} answered {reply.status}")
                    if sent >= opens:
                        latencies.append(time.monotonic() - sent)
            await asyncio.gather(*(loop() for _ in range(concurrency)))
        return latencies

    return asyncio.run(run())


def measure(url: str, body: bytes, concurrency: int, processes: int, duration: float) -> tuple[float, float]:
    """images/s and p50 milliseconds of ``processes`` load processes at once."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(load, [(url, body, concurrency, duration, 1.0)] * processes)
    latencies = [latency for part in parts for latency in part]
    return len(latencies) / duration, 1000 * statistics.median(latencies)


def wait_until_answering(url: str, body: bytes, process: subprocess.Popen, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited {process.returncode} before answering")
        with contextlib.suppress(OSError):
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.5)
    raise SystemExit(f"{name} did not answer within {timeout:.0f} s")


@contextlib.contextmanager
def started(command: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """A server process, stopped by its PID when done (SIGTERM, then SIGKILL after 30 s)."""
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # LitServe's workers are its children, in its session
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@contextlib.contextmanager
def paused(process: subprocess.Popen) -> Iterator[None]:
    """The server's processes stopped (SIGSTOP to its process group) while the other is measured: an idle LitServe
    keeps about a fifth of a core busy polling, which the other server would otherwise lose."""
    os.killpg(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(process.pid, signal.SIGCONT)


def grpc_point(port: int, concurrency: int, duration: float) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-m", "resnet_client.cli", "--server", f"127.0.0.1:{port}", "bench",
                           "--duration", str(duration), "--warmup", "1", "--json", "--quiet", "--input", "uint8",
                           "--image-size", "224x224", "--concurrency", str(concurrency), "--metrics", ""],
                          check=True, capture_output=True, text=True, timeout=duration * 4 + 120)
    point = json.loads(done.stdout.splitlines()[-1])
    return point["images_per_s"], point["p50_ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--litserve-python", default=sys.executable,
                        help="a Python with litserve, onnxruntime, numpy and pillow (default: this one)")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight a load process (default 8)")
    parser.add_argument("--processes", type=int, default=2, help="load processes (default 2)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each server once a round (default 3)")
    parser.add_argument("--calibration-images", type=int, default=40,
                        help="random JPEGs the int8 model is calibrated on (default 40)")
    parser.add_argument("--grpc", action="store_true", help="also load ours through resnet-client bench (gRPC)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument("--serve-litserve", nargs=2, metavar=("MODEL", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_litserve:
        serve_litserve(args.serve_litserve[0], int(args.serve_litserve[1]))
        return 0
    from runtime_cost import in_process, quantized_model

    bodies = request_bodies()
    ours_port, ours_http, litserve_port = BASE_PORT, BASE_PORT + 1, BASE_PORT + 2
    urls = {"litserve": f"http://127.0.0.1:{litserve_port}/predict", "ours": f"http://127.0.0.1:{ours_http}/v1/classify"}
    with tempfile.TemporaryDirectory() as folder:
        model = quantized_model(Path(folder), args.calibration_images)
        ours = [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(ours_port), "--http-port",
                str(ours_http), "--metrics-port", "0", "--device", "cpu", "--runtime",
                "onnxruntime", "--precision", "int8", "--weights", str(model)]
        theirs = [args.litserve_python, __file__, "--serve-litserve", str(model), str(litserve_port)]
        with started(ours, Path(folder) / "ours.log") as our_process, \
                started(theirs, Path(folder) / "litserve.log") as their_process:
            wait_until_answering(urls["ours"], bodies["ours"], our_process, "resnet-server")
            wait_until_answering(urls["litserve"], bodies["litserve"], their_process, "LitServe")
            processes = {"ours": our_process, "litserve": their_process}
            measured: dict[str, list[tuple[float, float]]] = {name: [] for name in ("ours", "litserve", "ours grpc")}
            ceilings = []
            for round_index in range(args.rounds):
                order = ["ours", "litserve"] if round_index % 2 == 0 else ["litserve", "ours"]
                for name in order:
                    with paused(processes["litserve" if name == "ours" else "ours"]):
                        measured[name].append(measure(urls[name], bodies[name], args.concurrency, args.processes,
                                                      args.duration))
                if args.grpc:
                    with paused(their_process):
                        measured["ours grpc"].append(grpc_point(ours_port, args.concurrency * args.processes,
                                                                args.duration))
                with paused(our_process), paused(their_process):
                    ceilings.append(in_process(ours[ours.index("--runtime"):], BATCH, args.duration))
    litserve_rate, ceiling = statistics.median(rate for rate, _ in measured["litserve"]), statistics.median(ceilings)
    results: dict[str, object] = {
        name: {"images_per_s": statistics.median(rate for rate, _ in points),
               "p50_ms": statistics.median(p50 for _, p50 in points),
               "ratio_to_litserve": statistics.median(rate for rate, _ in points) / litserve_rate,
               "of_in_process": statistics.median(rate for rate, _ in points) / ceiling,
               "rounds": [round(rate, 1) for rate, _ in points]}
        for name, points in measured.items() if points}
    results["in_process_images_per_s"] = ceiling
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"in process (bench-model, batch {BATCH}): {ceiling:.1f} images/s")
    for name, row in results.items():
        if isinstance(row, dict):
            print(f"{name:>10}  {row['images_per_s']:7.1f} images/s  p50 {row['p50_ms']:7.1f} ms  "
                  f"x{row['ratio_to_litserve']:.2f} of LitServe  x{row['of_in_process']:.2f} of in process  "
                  f"rounds {row['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
