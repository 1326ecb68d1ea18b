"""A greedy caller beside a polite one: what each gets of the device with ``--fair-share token`` and with ``off``
(first come, first served), side by side in one run.

Two ``resnet-server --frontends 1 --device cpu`` on 127.0.0.1 (seeded random weights, two bearer tokens), one
with each mode. Each round, on each server in turn (the order rotating): the greedy caller alone (``resnet-client
bench`` with ``--greedy`` calls in flight), then the greedy and the polite caller (one call in flight) at once, each
with its own token, uint8 224x224 images, ``--duration`` seconds. Reported per mode (medians of the rounds): each
caller's images/s and p50, the polite caller's p50 over the greedy one's, and the greedy caller's images/s beside
the polite one against alone. The servers are stopped (SIGTERM, by PID) when done.

Usage: python scripts/benchmarks/fair_share.py [--greedy 48] [--duration 10] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from served import ServedProcess, in_rotating_rounds, serving

BASE_PORT = 50401
MODES = ("token", "off")
TOKENS = {"greedy": "greedy-token", "polite": "polite-token"}


def bench(server: ServedProcess, token: str, concurrency: int, duration: float) -> subprocess.Popen:
    """A ``resnet-client bench`` started against ``server`` with ``token``; its JSON point on stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "resnet_client.cli", "--server", f"127.0.0.1:{server.port}", "--token", token,
         "bench", "--duration", str(duration), "--warmup", "1", "--json", "--quiet", "--input", "uint8",
         "--image-size", "224x224", "--concurrency", str(concurrency), "--metrics", ""],
        stdout=subprocess.PIPE, text=True)


def point(process: subprocess.Popen, duration: float) -> dict:
    out, _ = process.communicate(timeout=duration * 4 + 120)
    if process.returncode != 0:
        raise SystemExit(f"resnet-client bench exited {process.returncode}")
    return json.loads(out.splitlines()[-1])


def measure(server: ServedProcess, greedy: int, duration: float) -> dict:
    """The greedy caller alone, then beside the polite one: images/s and p50 of each."""
    alone = point(bench(server, TOKENS["greedy"], greedy, duration), duration)
    both = {"greedy": bench(server, TOKENS["greedy"], greedy, duration),
            "polite": bench(server, TOKENS["polite"], 1, duration)}
    measured = {name: point(process, duration) for name, process in both.items()}
    return {"greedy_alone": alone["images_per_s"],
            **{f"{name}_images_per_s": row["images_per_s"] for name, row in measured.items()},
            **{f"{name}_p50_ms": row["p50_ms"] for name, row in measured.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--greedy", type=int, default=48, help="the greedy caller's calls in flight (default 48)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each mode once a round (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        tokens = Path(folder) / "tokens"
        tokens.write_text("".join(f"{token}\n" for token in TOKENS.values()))
        flags_by_port = {BASE_PORT + index: ["--metrics-port", "0", "--http-port", "0", "--auth-token-file",
                                             str(tokens), "--fair-share", mode] for index, mode in enumerate(MODES)}
        with serving(flags_by_port) as by_port:
            measured = in_rotating_rounds(dict(zip(MODES, by_port.values(), strict=True)), args.rounds,
                                          lambda server: measure(server, args.greedy, args.duration))
    results = {}
    for mode, rounds in measured.items():
        row = {key: statistics.median(point[key] for point in rounds) for key in rounds[0]}
        row["polite_p50_to_greedy"] = row["polite_p50_ms"] / row["greedy_p50_ms"]
        row["greedy_beside_to_alone"] = row["greedy_images_per_s"] / row["greedy_alone"]
        results[mode] = row
    results["polite_images_per_s_to_off"] = results["token"]["polite_images_per_s"] / \
        results["off"]["polite_images_per_s"]
    if args.json:
        print(json.dumps(results))
    else:
        for mode in MODES:
            row = results[mode]
            print(f"{mode:>5}  polite {row['polite_images_per_s']:6.1f} images/s p50 {row['polite_p50_ms']:7.1f} ms"
                  f"  greedy {row['greedy_images_per_s']:6.1f} images/s p50 {row['greedy_p50_ms']:7.1f} ms"
                  f"  polite/greedy p50 x{row['polite_p50_to_greedy']:.2f}"
                  f"  greedy beside/alone x{row['greedy_beside_to_alone']:.2f}")
        print(f"polite images/s, token against off: x{results['polite_images_per_s_to_off']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
