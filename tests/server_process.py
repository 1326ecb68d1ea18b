"""A whole ``resnet-server`` as users run it, in a subprocess of the test: its log read as it comes, its
processes found by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.helpers import free_port


class Workers:
    """``python -m server --frontends 2`` on 127.0.0.1, port 0; its log lines collected as they come."""

    def __init__(self, weights: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.metrics_port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "resnet_server", "--frontends", "2", "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", str(self.metrics_port), "--device", "cpu", "--weights", weights,
             "--grace-period", "20", *extra],
            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._logged = threading.Condition()
        threading.Thread(target=self._collect, daemon=True).start()  # also keeps the pipe drained

    def _collect(self) -> None:
        for line in self.process.stderr:
            with self._logged:
                self.lines.append(line)
                self._logged.notify_all()
        with self._logged:
            self.lines.append("")  # the end of the log: the server has exited
            self._logged.notify_all()

    def read_until(self, count: int, text: str, timeout: float = 120) -> list[str]:
        """Once ``count`` log lines hold ``text``: those lines."""
        def found() -> list[str]:
            return [line for line in self.lines if text in line]

        with self._logged:
            if not self._logged.wait_for(lambda: len(found()) >= count or self.lines[-1:] == [""], timeout):
                raise AssertionError(f"no {count} lines with {text!r} within {timeout}s:\n" + "".join(self.lines))
            if len(found()) < count:
                raise AssertionError("the server exited early:\n" + "".join(self.lines))
            return found()[:count]

    def count(self, text: str) -> int:
        """How many log lines so far hold ``text``."""
        with self._logged:
            return sum(text in line for line in self.lines)

    def serving(self, count: int = 2) -> tuple[int, list[int]]:
        """Once ``count`` front-ends (counting replacements) serve: the shared port and their pids."""
        pids = [pid_in(line) for line in self.read_until(count, "started resnet-frontend")]
        ports = {int(line.split(" on 127.0.0.1:")[1].split()[0]) for line in self.read_until(count, "serving resnet18")}
        assert len(ports) == 1
        return ports.pop(), pids

    def http_port(self) -> int:
        """The HTTP port the front-ends serve (a server started with --http-port)."""
        line = self.read_until(1, "HTTP on 127.0.0.1:")[0]
        return int(line.split("HTTP on 127.0.0.1:")[1].split(";")[0])

    def terminate(self, pids: list[int]) -> None:
        """SIGTERM the supervisor: it drains and exits 0, and every one of ``pids`` has ended."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0
        assert all(gone(pid) for pid in pids)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


    def engine_pids(self, count: int = 1) -> list[int]:
        """Once ``count`` engines (counting restarts) have started: their pids."""
        return [pid_in(line) for line in self.read_until(count, "started resnet-engine")]


def pid_in(line: str) -> int:
    return int(line.rsplit("pid ", 1)[1].rstrip(")\n"))


def gone(pid: int) -> bool:
    """The process has ended: no such process, or a zombie waiting to be reaped (by an init that may never)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # the second: it ended between the open and the read
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def children_of(pid: int) -> list[int]:
    """The pids of the process's children (each thread's list: a child belongs to the thread that forked it)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def helper_pid(supervisor: int, module: str) -> int:
    """The pid of multiprocessing's helper process that runs ``module`` (``forkserver``, ``resource_tracker``)
    for the supervisor."""
    (found,) = [child for child in children_of(supervisor)
                if f"multiprocessing.{module} import main" in Path(f"/proc/{child}/cmdline").read_text()]
    return found
