"""A child process's life tied to its supervisor's."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_supervisor() -> None:
    """In a child: SIGTERM it when the supervisor ends, even by SIGKILL (Linux's PR_SET_PDEATHSIG), so that no
    engine or front-end outlives its server holding a device or a port; if the supervisor has already gone,
    end now."""
    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
