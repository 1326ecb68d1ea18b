"""A ``resnet-server`` that a benchmark of this folder starts on 127.0.0.1 and stops (SIGTERM, by PID): started
with the flags given, ready once it logs that it serves, its first front-end's CPU time read from /proc, and
``resnet-client bench`` points against it. Several start side by side (``serving``), each importing torch while
the others do, and stop side by side (``stop_all``).
A module of the benchmarks that run whole servers (tracing_cost.py, shared_memory_cost.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class ServedProcess:
    def __init__(self, port: int, flags: list[str], tree: str = "") -> None:
        """``tree``: a checkout of another version whose server runs instead (its packages put first on the path)."""
        self.port = port
        # HTTP off unless the flags ask for it: several servers side by side would all want its default port. By
        # its env twin, which a tree from before HTTP ignores.
        env = {"RESNET_SERVER_HTTP_PORT": "0", **os.environ}
        if tree:
            env["PYTHONPATH"] = os.pathsep.join(str(Path(tree) / part) for part in ("server", "client"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--weights", "random", "--frontends", "1", *flags], stderr=subprocess.PIPE, text=True, env=env)
        self.flags = flags
        self.frontend = 0

    def wait_serving(self) -> None:
        """Returns once the server logs that it serves; SystemExit if it ends first."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if "started resnet-frontend-0 (pid " in line:
                self.frontend = int(line.rsplit("pid ", 1)[1].rstrip(")\n"))
            if "serving resnet18 on" in line:
                threading.Thread(target=self.process.stderr.read, daemon=True).start()  # keeps the pipe drained
                return
        raise SystemExit(f"a server exited before serving (flags {self.flags})")

    def frontend_cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.frontend}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def bench(self, duration: float, *flags: str) -> dict:
        """One ``resnet-client bench --json`` point against this server, its flags after ``bench``."""
        done = subprocess.run(
            [sys.executable, "-m", "resnet_client.cli", "--server", f"127.0.0.1:{self.port}", "bench", "--duration",
             str(duration), "--warmup", "1", "--json", "--quiet", *flags], capture_output=True, text=True, check=True,
            timeout=duration * 4 + 120)
        return json.loads(done.stdout.splitlines()[-1])


def stop_all(servers: Iterable[ServedProcess]) -> None:
    servers = list(servers)
    for server in servers:
        server.process.send_signal(signal.SIGTERM)
    for server in servers:
        server.process.wait(60)


@contextmanager
def serving(flags_by_port: dict[int, list[str]], trees: dict[int, str] | None = None
            ) -> Iterator[dict[int, ServedProcess]]:
    """A server on each port with its flags (from the checkout ``trees`` gives the port, if any), all started
    before any is waited for; all stopped at the end, those that served and those that did not."""
    servers: dict[int, ServedProcess] = {}
    try:
        for port, flags in flags_by_port.items():
            servers[port] = ServedProcess(port, flags, (trees or {}).get(port, ""))
        for server in servers.values():
            server.wait_serving()
        yield servers
    finally:
        stop_all(servers.values())


def in_rotating_rounds(servers: dict[str, ServedProcess], rounds: int, measure: Callable[[ServedProcess], object]
                       ) -> dict[str, list]:
    """``measure`` of each server once a round, by name, in an order that rotates each round (a shared VM drifts
    from one minute to the next; a drift then falls on every server alike)."""
    names = list(servers)
    measured: dict[str, list] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            measured[name].append(measure(servers[name]))
    return measured
