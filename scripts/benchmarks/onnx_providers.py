"""An ONNX model's forward pass under each execution provider the installed ONNX Runtime has, in process: the CPU
provider, and OpenVINO's where the onnxruntime-openvino build is installed (it replaces onnxruntime, so run this
with a Python that has it: it needs only that and NumPy).

Each provider gets a session with ``--threads`` threads (OpenVINO's ``num_of_threads``), a random float batch of
``--batch`` images [3, 224, 224], two warm-up passes, then passes for ``--duration`` seconds; rounds rotate the
providers' order. Reported: the median images/s of the rounds per provider and against the CPU provider's, and
the largest difference of the logits from the CPU provider's on the same batch.

Usage: python scripts/benchmarks/onnx_providers.py --model FILE.onnx [--batch 8] [--threads 2] [--duration 10]
       [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

CPU, OPENVINO = "CPUExecutionProvider", "OpenVINOExecutionProvider"


def session(model: str, provider: str, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if provider == OPENVINO:
        openvino_options = {"device_type": "CPU", "num_of_threads": str(threads)}
        return onnxruntime.InferenceSession(model, options, providers=[OPENVINO, CPU],
                                            provider_options=[openvino_options, {}])
    return onnxruntime.InferenceSession(model, options, providers=[CPU])


def rate(running, batch: np.ndarray, duration: float) -> float:
    """Images/s of the session's passes over ``batch`` for ``duration`` seconds, after two warm-up passes."""
    name = running.get_inputs()[0].name
    running.run(None, {name: batch}), running.run(None, {name: batch})
    passes, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < duration:
        running.run(None, {name: batch})
        passes += 1
    return passes * len(batch) / elapsed


def main(argv: list[str] | None = None) -> int:
    import onnxruntime

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the ONNX model (float [N, 3, 224, 224] in)")
    parser.add_argument("--batch", type=int, default=8, help="images a pass (default 8)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads a session (default: every core)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each provider once a round (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = parser.parse_args(argv)
    providers = [provider for provider in (CPU, OPENVINO) if provider in onnxruntime.get_available_providers()]
    sessions = {provider: session(args.model, provider, args.threads) for provider in providers}
    batch = np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224)).astype(np.float32)
    logits = {provider: running.run(None, {running.get_inputs()[0].name: batch})[0]
              for provider, running in sessions.items()}
    rates: dict[str, list[float]] = {provider: [] for provider in providers}
    for round_index in range(args.rounds):
        shift = round_index % len(providers)
        for provider in providers[shift:] + providers[:shift]:
            rates[provider].append(rate(sessions[provider], batch, args.duration))
    cpu_rate = statistics.median(rates[CPU])
    results = {provider: {"images_per_s": statistics.median(values),
                          "ratio_to_cpu": statistics.median(values) / cpu_rate,
                          "largest_logit_difference": float(np.abs(logits[provider] - logits[CPU]).max()),
                          "rounds": [round(value, 1) for value in values]}
               for provider, values in rates.items()}
    results["onnxruntime"] = onnxruntime.__version__
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"ONNX Runtime {onnxruntime.__version__}, batch {args.batch}, {args.threads} threads")
    for provider in providers:
        row = results[provider]
        print(f"{provider:>26}  {row['images_per_s']:7.1f} images/s  x{row['ratio_to_cpu']:.2f}  largest logit "
              f"difference {row['largest_logit_difference']:.3g}  rounds {row['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
