"""Keep the host memory a forward pass frees for the next pass (glibc malloc), rather than fault it back in.

A ResNet18 forward pass on the CPU allocates and frees tens of MB of activations (a batch of eight: 26 MB
for the first convolution's output alone). glibc hands large freed blocks back to the kernel: blocks above
its mmap threshold are unmapped, and free memory at the top of a heap beyond its trim threshold is returned.
The next pass then takes that memory back a page at a time. Whether that happens depends on the heap's state
when the model loads, since glibc raises its mmap threshold as it goes: measured on the 2-core VM, the same
batch-8 pass took about 19,000 minor page faults (76 MB) in one process and about 3,500 in another that
differed only in the order it imported its modules, and ran 10-20% slower (docs/performance.md, "Found and
fixed: page faults in the forward pass"). Fixing both thresholds makes it 0 whatever the heap's state, for
the peak working set kept in the process (tens of MB more resident memory).

glibc only: ``mallopt`` elsewhere (musl) does nothing or is missing, and this then reports False. Blocks
above 32 MB, glibc's largest mmap threshold, are still unmapped when freed (on the CPU the first
activation from a batch of 16 up). An operator who sets either threshold with glibc's own settings
(``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES=glibc.malloc.trim_threshold=...``) keeps those values: this
then changes nothing and reports False (``MALLOC_TRIM_THRESHOLD_=131072``, glibc's default value, turns it off).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1024 * 1024 * 1024  # free memory at a heap's top is kept up to this much


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's malloc to keep freed blocks up to 32 MB and not trim its heaps; True if it took."""
    if thresholds_set_by_operator(environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


# glibc's own ways to set the same two thresholds, at process start: where any is set, the operator's values stand.
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OPERATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def thresholds_set_by_operator(environ: Mapping[str, str]) -> bool:
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(name in environ for name in OPERATOR_VARIABLES) or any(name in tunables for name in OPERATOR_TUNABLES)
