"""How many torch (OpenMP) threads the calling thread computes with.

``torch.set_num_threads`` sets the calling thread's OpenMP team size and also a process-wide value,
and a thread that has not yet run a parallel op takes whatever process-wide value is current when it
first does (torch initialises each thread's team size lazily). Left alone, a thread's team could then
follow another thread's later call: a replica's worker could compute one-threaded because a
preprocessing thread asked for one. :func:`use_torch_threads` settles the calling thread's own size
at once.

Why threads that do not compute must not keep teams either: libgomp counts the workers of every team in
the process, and once they outnumber the cores it cuts how long a thread spins at a barrier before it
sleeps, and a worker's forward pass slows by half or more (docs/performance.md, "Figures behind the
code").
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

BACKGROUND_NICENESS = 19


def in_the_background() -> None:
    """The calling thread computes with one torch thread, at the lowest CPU priority (Linux sets a thread's
    niceness apart from its process's): work that can wait (preparing new weights) then takes only the CPU the
    batches leave."""
    use_torch_threads(1)
    with contextlib.suppress(OSError):  # lowering one's own priority is always allowed; a platform may not offer it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


def use_torch_threads(count: int) -> None:
    """The calling thread computes with ``count`` torch threads from now on, whatever other threads set."""
    torch.get_num_threads()  # this thread's lazy initialisation, from the process-wide value, happens now...
    torch.set_num_threads(count)  # ...so this, not a later call elsewhere, decides its team size
