"""Reloads under load (not in CI): what a swap of the weights costs the callers of a server that serves on.

Starts its own resnet-server on 127.0.0.1 (``--model-control explicit``), has ``--callers`` threads call it with
tritonclient's ModelInfer (one 224x224 uint8 image a call) for ``--duration`` seconds, and meanwhile loads
``--reloads`` times, alternating two seeded weight files sent with ``load_model(..., files=...)`` (or, with
``--from-path``, put in place of the server's ``--weights`` file and reloaded from there). Reports:
answers by status code (all must be OK), answers whose probabilities are not those of the version they name
(within 1e-5 of torchvision's; must be 0), p99 latency of calls that overlapped a reload (from a second before
it to a second after) against the steady p99 (target: at most 2x), the RSS of all the server's processes during
reloads against their steady RSS (target: at most two copies of the weights file more) and each process's rise,
and each load call's time. Stops the server (SIGTERM, by its PID) at the end; exit 1 if a target is missed.

Usage: python scripts/benchmarks/reload_bench.py [--duration 60] [--callers 16] [--reloads 5] [--compile] [--device cpu]
       [--from-path] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as tc
from torchvision.models import resnet18
from torchvision.transforms import v2

PORT = 50178
PIXELS = np.random.default_rng(7).integers(0, 256, (224, 224, 3), dtype=np.uint8)
SEEDS = (1, 2)


def weights_file(folder: Path, seed: int) -> tuple[Path, np.ndarray]:
    """A seeded ResNet18 saved as a state_dict, and torchvision's probabilities for PIXELS under it."""
    torch.manual_seed(seed)
    model = resnet18(weights=None).eval()
    path = folder / f"seed{seed}.pt"
    torch.save(model.state_dict(), path)
    transform = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    with torch.inference_mode():
        logits = model(transform(torch.from_numpy(PIXELS).permute(2, 0, 1)).unsqueeze(0))[0]
    return path, torch.softmax(logits, 0).numpy()


def start_server(weights: Path, extra: list[str]) -> tuple[subprocess.Popen, dict[int, str]]:
    """The server, serving, and its processes' names by PID (as its log says it started them)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(PORT), "--metrics-port", "0",
         "--weights", str(weights), "--model-control", "explicit", *extra],
        stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    names = {server.pid: "supervisor"}
    for line in server.stderr:
        if started := re.search(r"started (\S+) \(pid (\d+)\)", line):
            names[int(started[2])] = started[1]
        if "serving resnet18 on" in line:
            threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained
            return server, names
    raise SystemExit(f"the server exited before serving (code {server.wait()})")


def rss_by_process(pid: int) -> dict[int, int]:
    """The RSS of ``pid`` and of every process under it, by PID."""
    found, pending = {}, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            found[current] = int(next(line for line in status.splitlines()
                                      if line.startswith("VmRSS")).split()[1]) * 1024
            pending += [int(child) for task in Path(f"/proc/{current}/task").iterdir()
                        for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # it ended meanwhile
    return found


class Load:
    """Callers and an RSS sampler, recording until stopped."""

    def __init__(self, callers: int, references: dict[str, np.ndarray], server_pid: int, tolerance: float) -> None:
        self.references, self.tolerance = references, tolerance
        self.calls: list[tuple[float, float, str]] = []  # (start, end, status code or "WRONG" or "OK")
        self.rss: list[tuple[float, dict[int, int]]] = []  # (when, RSS by PID)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._call, daemon=True) for _ in range(callers)]
        self._threads.append(threading.Thread(target=self._sample, args=(server_pid,), daemon=True))
        for thread in self._threads:
            thread.start()

    def _call(self) -> None:
        client = tc.InferenceServerClient(f"127.0.0.1:{PORT}")
        tensor = tc.InferInput("input", [1, 224, 224, 3], "UINT8")
        tensor.set_data_from_numpy(PIXELS[None])
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                result = client.infer("resnet18_uint8", [tensor])
                version = result.get_response().model_version
                close = np.abs(result.as_numpy("probabilities")[0] - self.references[version]).max() <= self.tolerance
                code = "OK" if close else "WRONG"
            except tc.InferenceServerException as exc:
                code = str(exc.status())
            with self._lock:
                self.calls.append((start, time.monotonic(), code))

    def _sample(self, pid: int) -> None:
        while not self._stop.wait(0.05):  # often enough to see a file's receive, which takes a few tenths
            self.rss.append((time.monotonic(), rss_by_process(pid)))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


def p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) if latencies else float("nan")


def summarise(load: Load, reloads: list[tuple[float, float]], file_bytes: int, names: dict[int, str]) -> dict:
    def near_a_reload(start: float, end: float) -> bool:
        return any(start <= until + 1 and end >= since - 1 for since, until in reloads)

    codes: dict[str, int] = {}
    for _, _, code in load.calls:
        codes[code] = codes.get(code, 0) + 1
    steady = [end - start for start, end, code in load.calls if code == "OK" and not near_a_reload(start, end)]
    around = [end - start for start, end, code in load.calls if code == "OK" and near_a_reload(start, end)]
    steady_rss = [sum(rss.values()) for when, rss in load.rss if not near_a_reload(when, when)]
    reload_rss = [sum(rss.values()) for when, rss in load.rss if near_a_reload(when, when)]
    return {
        "codes": codes, "steady_p99_s": p99(steady), "around_swap_p99_s": p99(around),
        "p99_ratio": p99(around) / p99(steady), "load_call_s": [round(until - since, 3) for since, until in reloads],
        "steady_rss_mb": float(np.median(steady_rss)) / 2**20, "reload_rss_max_mb": max(reload_rss) / 2**20,
        "rss_allowance_mb": 2 * file_bytes / 2**20,
        "reload_rss_rise_by_process_mb": rises_by_process(load.rss, near_a_reload, names),
    }


def rises_by_process(samples: list[tuple[float, dict[int, int]]], near_a_reload, names: dict[int, str]
                     ) -> dict[str, float]:
    """Each process's largest RSS around reloads less its own steady median, by its name."""
    rises = {}
    for pid in {pid for _, rss in samples for pid in rss}:
        steady = [rss[pid] for when, rss in samples if pid in rss and not near_a_reload(when, when)]
        around = [rss[pid] for when, rss in samples if pid in rss and near_a_reload(when, when)]
        if steady and around:
            rises[names.get(pid, f"pid {pid}")] = round((max(around) - float(np.median(steady))) / 2**20, 1)
    return dict(sorted(rises.items(), key=lambda item: -item[1]))


def load_weights(triton: tc.InferenceServerClient, weights: Path, served: Path | None) -> None:
    """Load ``weights``: sent with the call, or (``served``) put where --weights names and reloaded from there."""
    if served is None:
        triton.load_model("resnet18", files={"file:1/weights.pt": weights.read_bytes()})
        return
    staging = served.with_suffix(".new")
    shutil.copyfile(weights, staging)
    os.replace(staging, served)
    triton.load_model("resnet18")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--callers", type=int, default=16, help="threads calling (default 16)")
    parser.add_argument("--reloads", type=int, default=5, help="loads during the run (default 5)")
    parser.add_argument("--compile", action="store_true",
                        help="serve with --compile and a compile cache warmed by a first start (the reload then "
                             "compiles from that cache)")
    parser.add_argument("--device", default="cpu", help="the server's --device (default cpu; cuda:0 on a GPU)")
    parser.add_argument("--server-flags", default="", help="more flags for the server, e.g. '--precision fp32'")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest difference from torchvision's fp32 probabilities (default 1e-5; fp16 on a GPU "
                             "needs about 1e-3)")
    parser.add_argument("--from-path", action="store_true",
                        help="reload from the server's --weights file, rewritten before each load (as SIGHUP after a "
                             "volume's update does), instead of sending the file")
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="reload-bench-"))
    (first, first_reference), (second, second_reference) = (weights_file(folder, seed) for seed in SEEDS)
    compiled = ["--compile", "--compile-cache", str(folder / "inductor")] if args.compile else []
    extra = ["--device", args.device, *shlex.split(args.server_flags), *compiled]
    if args.compile:  # a first start fills the cache, as a deployment's earlier start would have
        warming, _ = start_server(first, extra)
        warming.send_signal(signal.SIGTERM)
        warming.wait(120)
    served = folder / "served.pt"  # --weights, rewritten before each load with --from-path
    shutil.copyfile(first, served)
    server, names = start_server(served, extra)
    files = [second, first]
    references = {str(version): (first_reference, second_reference)[(version - 1) % 2]
                  for version in range(1, args.reloads + 2)}
    load = Load(args.callers, references, server.pid, args.tolerance)
    reloads = []
    try:
        pause = args.duration / (args.reloads + 1)
        triton = tc.InferenceServerClient(f"127.0.0.1:{PORT}")
        for index in range(args.reloads):
            time.sleep(pause)
            since = time.monotonic()
            load_weights(triton, files[index % 2], served if args.from_path else None)
            reloads.append((since, time.monotonic()))
        time.sleep(pause)
    finally:
        load.stop()
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    results = summarise(load, reloads, first.stat().st_size, names)
    results.update(device=args.device, compile=args.compile, callers=args.callers, duration_s=args.duration,
                   sent="path" if args.from_path else "files")
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    missed = (set(results["codes"]) != {"OK"} or results["p99_ratio"] > 2
              or results["reload_rss_max_mb"] > results["steady_rss_mb"] + results["rss_allowance_mb"])
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
