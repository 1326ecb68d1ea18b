"""Callers sharing one device under ``--fair-share``, against ``off`` (first come, first served), side by side in
one run. Scenarios (``--scenario``, one or more):

- ``polite``: a greedy caller (``--greedy`` calls in flight) alone, then beside a polite one (one call in flight),
  each with its own bearer token, on a ``token`` server and an ``off`` one. Reported per mode: each caller's
  images/s and p50, the polite caller's p50 over the greedy one's, the greedy caller's images/s beside the polite
  one against alone.
- ``weights``: two tokens of weights 3 and 1, each with ``--greedy`` calls in flight, on the ``token`` server:
  each one's images/s and their ratio (3 where the weights are followed).
- ``peer``: ``polite`` without tokens, by address, on a ``peer`` server and an ``off`` one, both listening on a
  veth pair into a network namespace this script makes: the greedy caller on the host side with four
  connections, the polite one inside the namespace (another address). Needs root and iproute2.
- ``alone``: one caller (16 calls in flight) on the ``token`` and ``off`` servers, and with ``--before TREE`` on
  a server run from TREE (a checkout of the code before fair share, no flags of its own): images/s and p99 of
  each, to see that fair share costs a lone caller nothing.

Each server: ``resnet-server --frontends 1 --device cpu``, seeded random weights, uint8 224x224 images,
``--duration`` seconds a window, rounds rotating the servers' order, medians of the rounds. Servers are stopped
(SIGTERM, by PID) and the namespace deleted when done.

Usage: python scripts/benchmarks/fair_share.py [--scenario polite weights peer alone] [--greedy 48]
       [--duration 10] [--rounds 2] [--server-flags "..."] [--before TREE] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from served import ServedProcess, in_rotating_rounds, serving

BASE_PORT = 50401
SCENARIOS = ("polite", "weights", "peer", "alone")
TOKEN_FILE = ("greedy-token name=greedy\npolite-token name=polite\nheavy-token name=heavy weight=3\n"
              "light-token name=light weight=1\n")
NAMESPACE = f"resnet-fair-{os.getpid()}"
HOST_ADDRESS, NAMESPACE_ADDRESS = "10.201.0.1", "10.201.0.2"


class Caller:
    """How one caller reaches a server: its token, its connections, the namespace it runs in."""

    def __init__(self, token: str = "", connections: int = 1, namespace: str = "") -> None:
        self.token, self.connections, self.namespace = token, connections, namespace

    def bench(self, server: ServedProcess, host: str, concurrency: int, duration: float) -> subprocess.Popen:
        """A ``resnet-client bench`` started against ``server``; its JSON point on stdout."""
        command = [sys.executable, "-m", "resnet_client.cli", "--server", f"{host}:{server.port}", "bench",
                   "--duration", str(duration), "--warmup", "1", "--json", "--quiet", "--input", "uint8",
                   "--image-size", "224x224", "--concurrency", str(concurrency), "--metrics", "",
                   "--connections", str(self.connections)]
        if self.token:
            command[3:3] = ["--token", self.token]
        if self.namespace:
            command[:0] = ["ip", "netns", "exec", self.namespace]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def point(process: subprocess.Popen, duration: float) -> dict:
    out, _ = process.communicate(timeout=duration * 4 + 120)
    if process.returncode != 0:
        raise SystemExit(f"resnet-client bench exited {process.returncode}")
    return json.loads(out.splitlines()[-1])


def side_by_side(server: ServedProcess, host: str, callers: dict[str, tuple[Caller, int]], duration: float
                 ) -> dict[str, dict]:
    """Each named caller with its calls in flight, all at once: its bench point."""
    started = {name: caller.bench(server, host, concurrency, duration)
               for name, (caller, concurrency) in callers.items()}
    return {name: point(process, duration) for name, process in started.items()}


def greedy_and_polite(greedy: Caller, polite: Caller, host: str, in_flight: int, duration: float
                      ) -> Callable[[ServedProcess], dict]:
    """The greedy caller alone, then beside the polite one: images/s and p50 of each."""
    def measure(server: ServedProcess) -> dict:
        alone = side_by_side(server, host, {"greedy": (greedy, in_flight)}, duration)["greedy"]
        both = side_by_side(server, host, {"greedy": (greedy, in_flight), "polite": (polite, 1)}, duration)
        return {"greedy_alone": alone["images_per_s"],
                **{f"{name}_images_per_s": row["images_per_s"] for name, row in both.items()},
                **{f"{name}_p50_ms": row["p50_ms"] for name, row in both.items()}}
    return measure


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(point[key] for point in rounds) for key in rounds[0]}


def compared(measured: dict[str, list[dict]], fair: str) -> dict:
    """The greedy-and-polite rows of the fair mode and of off, with their ratios."""
    results = {}
    for mode, rounds in measured.items():
        row = medians(rounds)
        row["polite_p50_to_greedy"] = row["polite_p50_ms"] / row["greedy_p50_ms"]
        row["greedy_beside_to_alone"] = row["greedy_images_per_s"] / row["greedy_alone"]
        results[mode] = row
    polite = {mode: results[mode]["polite_images_per_s"] for mode in (fair, "off")}
    results["polite_images_per_s_to_off"] = polite[fair] / polite["off"]
    return results


def by_token(servers: dict[str, ServedProcess], args: argparse.Namespace) -> dict:
    """The scenarios run on the token and off servers (127.0.0.1)."""
    results: dict = {}
    pair = {mode: servers[mode] for mode in ("token", "off")}
    if "polite" in args.scenario:
        results["polite"] = compared(in_rotating_rounds(pair, args.rounds, greedy_and_polite(
            Caller("greedy-token"), Caller("polite-token"), "127.0.0.1", args.greedy, args.duration)), "token")
    if "weights" in args.scenario:
        callers = {"heavy": (Caller("heavy-token"), args.greedy), "light": (Caller("light-token"), args.greedy)}
        rounds = in_rotating_rounds({"token": servers["token"]}, args.rounds, lambda server: {
            f"{name}_images_per_s": row["images_per_s"]
            for name, row in side_by_side(server, "127.0.0.1", callers, args.duration).items()})["token"]
        row = medians(rounds)
        results["weights"] = {**row, "heavy_to_light": row["heavy_images_per_s"] / row["light_images_per_s"]}
    if "alone" in args.scenario:
        rounds = in_rotating_rounds(servers, args.rounds, lambda server: {
            key: side_by_side(server, "127.0.0.1", {"one": (Caller("greedy-token"), 16)}, args.duration)["one"][key]
            for key in ("images_per_s", "p99_ms")})
        results["alone"] = {mode: medians(mode_rounds) for mode, mode_rounds in rounds.items()}
    return results


@contextlib.contextmanager
def namespace() -> Iterator[str]:
    """A network namespace joined to this one by a veth pair: HOST_ADDRESS here, NAMESPACE_ADDRESS there."""
    here, there = f"rfh{os.getpid()}"[-15:], f"rfn{os.getpid()}"[-15:]
    steps = [["ip", "netns", "add", NAMESPACE],
             ["ip", "link", "add", here, "type", "veth", "peer", "name", there, "netns", NAMESPACE],
             ["ip", "addr", "add", f"{HOST_ADDRESS}/30", "dev", here], ["ip", "link", "set", here, "up"],
             ["ip", "-n", NAMESPACE, "addr", "add", f"{NAMESPACE_ADDRESS}/30", "dev", there],
             ["ip", "-n", NAMESPACE, "link", "set", there, "up"], ["ip", "-n", NAMESPACE, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield NAMESPACE
    finally:
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)  # takes the veth pair with it


def by_peer(args: argparse.Namespace, flags: list[str]) -> dict:
    """The peer scenario: a peer and an off server on the veth pair's host end."""
    with namespace() as name:
        listen = ["--host", HOST_ADDRESS]
        flags_by_port = {BASE_PORT + 10: [*flags, *listen, "--fair-share", "peer"],
                         BASE_PORT + 11: [*flags, *listen, "--fair-share", "off"]}
        with serving(flags_by_port) as by_port:
            servers = dict(zip(("peer", "off"), by_port.values(), strict=True))
            return compared(in_rotating_rounds(servers, args.rounds, greedy_and_polite(
                Caller(connections=4), Caller(namespace=name), HOST_ADDRESS, args.greedy, args.duration)), "peer")


def run(args: argparse.Namespace) -> dict:
    flags = ["--metrics-port", "0", "--http-port", "0", *shlex.split(args.server_flags)]
    results: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        tokens = Path(folder) / "tokens"
        tokens.write_text(TOKEN_FILE)
        if set(args.scenario) - {"peer"}:
            flags_by_port = {BASE_PORT: [*flags, "--auth-token-file", str(tokens), "--fair-share", "token"],
                             BASE_PORT + 1: [*flags, "--auth-token-file", str(tokens), "--fair-share", "off"]}
            if args.before:
                flags_by_port[BASE_PORT + 2] = flags  # the old code's defaults, without tokens
            with serving(flags_by_port, {BASE_PORT + 2: args.before}) as by_port:
                modes = ("token", "off", "before")[:len(by_port)]
                results.update(by_token(dict(zip(modes, by_port.values(), strict=True)), args))
    if "peer" in args.scenario:
        results["peer"] = by_peer(args, flags)
    return results


def printed(results: dict) -> None:
    for scenario, fair in (("polite", "token"), ("peer", "peer")):
        if scenario in results:
            for mode in (fair, "off"):
                row = results[scenario][mode]
                print(f"{scenario:>6} {mode:>5}  polite {row['polite_images_per_s']:6.1f} images/s p50 "
                      f"{row['polite_p50_ms']:7.1f} ms  greedy {row['greedy_images_per_s']:6.1f} images/s p50 "
                      f"{row['greedy_p50_ms']:7.1f} ms  polite/greedy p50 x{row['polite_p50_to_greedy']:.2f}  "
                      f"greedy beside/alone x{row['greedy_beside_to_alone']:.2f}")
            ratio = results[scenario]["polite_images_per_s_to_off"]
            print(f"{scenario:>6} polite images/s, {fair} against off: x{ratio:.2f}")
    if "weights" in results:
        row = results["weights"]
        print(f"weights 3:1  heavy {row['heavy_images_per_s']:6.1f} images/s  light {row['light_images_per_s']:6.1f}"
              f"  x{row['heavy_to_light']:.2f}")
    if "alone" in results:
        for mode, row in results["alone"].items():
            print(f" alone {mode:>5}  {row['images_per_s']:6.1f} images/s  p99 {row['p99_ms']:7.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=["polite"],
                        help="what to measure (default polite)")
    parser.add_argument("--greedy", type=int, default=48, help="the greedy callers' calls in flight (default 48)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a window (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each server once a round (default 2)")
    parser.add_argument("--server-flags", default="", help="more flags for every server (--before's too)")
    parser.add_argument("--before", default="", metavar="TREE",
                        help="alone: also a server run from this checkout (the code before fair share)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if "peer" in args.scenario and os.geteuid() != 0:
        parser.error("--scenario peer makes a network namespace: run it as root")
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        printed(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
