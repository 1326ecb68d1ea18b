"""Keep the CPU allocator from handing a batch's memory back to the kernel between batches.

A forward pass allocates and frees the same large activations every batch (batch 8 at 224x224: 25.7 MB
for the first convolution's output alone). glibc's malloc hands such blocks back to the kernel (munmap,
or trimming the top of a thread's heap) and the next batch takes them back one 4 KiB page fault at a
time. Measured on 2 cores, ResNet18 at batch 8 on a worker thread: 1,200-18,800 page faults per pass
untuned, none in most passes with the settings below; `resnet-server bench-model` faulted 1.4-1.5 M
times per run untuned, 0.2-0.4 M tuned, and gave 6-32% more images/s at batch 8 and 16 (three
alternating pairs; README, Performance). The cost is memory the process keeps: its peak working set
stays resident (about 75 MB more RSS for a CPU server after a batch-8 load).

Process-wide and idempotent; a no-op where the C library is not glibc (musl has no mallopt).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# glibc's largest mmap threshold on 64-bit (half its per-thread heap size): blocks up to it come from the heap.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # freed memory at a heap's top kept up to this size
TOP_PAD = 64 << 20  # each heap extension takes this much extra, so a growing batch extends it rarely


def retain_freed_memory() -> bool:
    """Tune glibc malloc as above; False (and nothing changed) where that is not possible."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: allocator left as it is")
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    applied = [mallopt(parameter, value) == 1 for parameter, value in settings]  # each, even if one is refused
    return all(applied)
