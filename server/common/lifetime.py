"""A child process's life tied to its supervisor's."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait


def die_with_supervisor() -> None:
    """In a child: SIGTERM it when the supervisor ends, even by SIGKILL, so that no engine or front-end outlives
    its server holding a device or a port (at once if the supervisor has already gone). The child's parent is
    the fork server (server.supervisor.launcher), which lives as long as any child does, so the supervisor's
    end is watched on its sentinel, a pipe that reads end-of-file once the supervisor has gone."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_terminate_when_gone, args=(parent.sentinel,), name="supervisor-watch",
                         daemon=True).start()


def _terminate_when_gone(supervisor_sentinel: int) -> None:
    wait([supervisor_sentinel])
    os.kill(os.getpid(), signal.SIGTERM)
