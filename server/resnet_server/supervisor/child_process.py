"""One engine or front-end process, watched by the supervisor itself rather than through the fork server.

multiprocessing learns that a fork-server child has ended from the fork server, which reaps it and writes its
exit code down a pipe; if the fork server dies, every pipe reads end-of-file and multiprocessing takes each child
for ended (code 255), though each still runs. A pidfd (Linux 5.3) watches the process itself: it becomes readable
when that process ends, whoever its parent is, and signals sent through it can never reach a later process that
reused the pid. The Process object is kept until its process has ended: dropping it closes the pipe each child
watches for the supervisor's end (resnet_server.common.lifetime).
"""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing import forkserver
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

REPORT_SECONDS = 1.0  # how long the fork server may take to report an exit code once the child has ended


class ChildProcess:
    """A started child: whether it runs, how it ended, and signals for it."""

    def __init__(self, process: BaseProcess) -> None:
        """Start ``process`` (from the fork server); what start() raises (the fork server gone mid-request, no
        memory to fork) propagates, and nothing is left running."""
        process.start()
        self.process = process
        self.name = process.name
        self.pid: int = process.pid or 0
        self._code: int | None = None
        try:
            self.sentinel = os.pidfd_open(self.pid)
        except ProcessLookupError:  # it has ended, and been reaped, already: a sentinel that is always ready
            self.sentinel, writer = os.pipe()
            os.close(writer)

    def alive(self) -> bool:
        return not wait([self.sentinel], 0)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for it to end; True once it has."""
        return bool(wait([self.sentinel], timeout))

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has ended meanwhile
            signal.pidfd_send_signal(self.sentinel, signum)

    def exit_code(self) -> int | None:
        """Its exit code (negative: the signal that ended it) once it has ended, as the fork server reports it;
        None while it runs, or when the fork server ended before it could report."""
        if self._code is None and not self.alive():
            self._code = _reported(self.process.sentinel)
        return self._code

    def describe_end(self) -> str:
        code = self.exit_code()
        return f"ended with code {code}" if code is not None else "ended (its code went with the fork server)"

    def close(self) -> None:
        """Once it has ended: release its pidfd (the fork server's pipe goes with the Process object)."""
        os.close(self.sentinel)


def _reported(report: int) -> int | None:
    if not wait([report], REPORT_SECONDS):
        return None
    try:
        return forkserver.read_signed(report)
    except (OSError, EOFError):  # the fork server ended first
        return None
