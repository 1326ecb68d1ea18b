"""A child process's life tied to its supervisor's."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import wait
from typing import NoReturn


def die_with_supervisor() -> None:
    """In a child: SIGTERM it when the supervisor ends, even by SIGKILL, so that no engine or front-end outlives
    its server holding a device or a port (at once if the supervisor has already gone). The child's parent is
    the fork server (resnet_server.supervisor.launcher), which lives as long as any child does, so the supervisor's
    end is watched on its sentinel, a pipe that reads end-of-file once the supervisor has gone."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_terminate_when_gone, args=(parent.sentinel,), name="supervisor-watch",
                         daemon=True).start()


def _terminate_when_gone(supervisor_sentinel: int) -> None:
    wait([supervisor_sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


def exit_at_once(code: int) -> NoReturn:
    """End the process without joining its threads: other replicas may still be loading or warming up on
    daemon threads, a hung one may never return, and the interpreter's shutdown can abort on a thread that is
    inside torch."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
