"""A worker of a ``--workers 2`` server killed under load: how many calls fail when one worker dies.

Starts ``python -m server --workers 2 --device cpu --weights random`` on 127.0.0.1. Each trial runs the bench's
closed loop (uint8 224x224, one image a call, ``--concurrency`` threads over ``--connections`` connections) for
``--seconds``, sends SIGKILL to worker 1 ``--kill-after`` seconds in, and counts the calls by outcome; the
next trial waits until the supervisor's replacement serves. Stops the server it started when done.

    python scripts/worker_kill.py --trials 8 --attempts 1 [--grpc-default-backoff]

``--grpc-default-backoff`` drops the client's reconnect backoff options (client/channel.py), leaving gRPC's.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from client import bench, channel
from client.api import classifier_pb2 as pb

STARTED = re.compile(r"started worker (\d+) of \d+ \(pid (\d+)\)")


class Server:
    """The --workers 2 server and its log, collected as it comes."""

    def __init__(self, port: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server", "--workers", "2", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", "0", "--device", "cpu", "--weights", "random"],
            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        self.lines: list[str] = []
        self.logged = threading.Condition()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stderr:
            with self.logged:
                self.lines.append(line)
                self.logged.notify_all()

    def wait_serving(self, count: int, timeout: float = 120) -> None:
        with self.logged:
            if not self.logged.wait_for(lambda: sum("serving resnet18" in line for line in self.lines) >= count,
                                        timeout):
                raise SystemExit("the server did not serve in time:\n" + "".join(self.lines[-20:]))

    def worker_pid(self, index: int) -> int:
        with self.logged:
            started = [STARTED.search(line) for line in self.lines]
        return [int(m[2]) for m in started if m and int(m[1]) == index][-1]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)


def trial(args: argparse.Namespace, server: Server, request: bytes) -> collections.Counter:
    victim = server.worker_pid(1)
    threading.Timer(args.kill_after, os.kill, (victim, signal.SIGKILL)).start()
    spec = bench.LoadSpec(f"127.0.0.1:{args.port}", request, args.concurrency, None, 0.0, args.seconds,
                          {"timeout": 30, "attempts": args.attempts}, connections=args.connections)
    return collections.Counter(code for _, code in bench._closed_loop(spec))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=50731)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--attempts", type=int, default=1, help="tries per call (the library's default is 3)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--kill-after", type=float, default=6.0)
    parser.add_argument("--grpc-default-backoff", action="store_true")
    args = parser.parse_args()
    if args.grpc_default_backoff:
        channel.RECONNECT_BACKOFF = []
    image = pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.UINT8, shape=[224, 224, 3], data=bytes(224 * 224 * 3)))
    request = pb.ClassifyRequest(images=[image], top_k=1).SerializeToString()
    server = Server(args.port)
    try:
        for number in range(args.trials):
            server.wait_serving(2 + number)  # both workers, counting the replacements so far
            codes = trial(args, server, request)
            print(f"trial {number + 1}: " + ", ".join(f"{code} {count}" for code, count in codes.most_common()),
                  flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
