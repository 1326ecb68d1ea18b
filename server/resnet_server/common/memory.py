"""Keep the host memory a forward pass frees for the next pass (glibc malloc), rather than fault it back in.

A ResNet18 forward pass on the CPU allocates and frees tens to hundreds of MB of activations (the first
convolution's output alone: 26 MB at batch 8, 51 MB at 16, 103 MB at 32). glibc hands large freed blocks back
to the kernel, and the next pass takes that memory back a page at a time: blocks above its mmap threshold
(32 MB at most) are unmapped when freed, a thread's arena is made of heaps of at most 64 MB that are given back
when empty, and free memory at the top of a heap beyond its trim threshold is returned: thousands of minor page
faults a pass, and a slower pass (docs/performance.md, "Figures behind the code").

So the process keeps one arena, the main one, which grows in one piece (brk) with no cap per heap; blocks never
get their own mapping, however large; and the heap's top is trimmed only past 1 GB: no faults, a smaller process,
and serving level with per-thread arenas.

A front-end runs no forward pass; it lets blocks of 32 MB or more be mapped on their own again (map_huge_blocks):
such blocks are rare there (a file of weights a client sends and gRPC's copies of it; a request of tens of MB),
and they then go back to the kernel when freed instead of staying in its heap for good.

glibc only: ``mallopt`` elsewhere (musl) does nothing or is missing, and this then reports False. Set before any
thread starts (the server package does it when imported): a thread that has allocated already keeps its arena.
An operator who tunes any of these with glibc's own settings (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_MAX_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or their ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``)
keeps malloc as set: this then changes nothing and reports False (``MALLOC_ARENA_MAX=8``, say, turns it off).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 1024 * 1024 * 1024  # free memory at the heap's top is kept up to this much
HUGE_BLOCK = 32 * 1024 * 1024  # glibc's largest mmap threshold
MMAP_MAX_DEFAULT = 65536  # glibc's own default for M_MMAP_MAX
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))

# glibc's own ways to set the same parameters, at process start: where any is set, the operator's malloc stands.
OPERATOR_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OPERATOR_TUNABLES = ("glibc.malloc.arena_max", "glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold",
                     "glibc.malloc.trim_threshold")


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's malloc to one arena, no block mapped on its own, the heap not trimmed below 1 GB;
    True if it took."""
    return _set_malloc(SETTINGS, environ)


def map_huge_blocks(environ: Mapping[str, str] = os.environ) -> bool:
    """Let blocks of HUGE_BLOCK or more have mappings of their own again, returned to the kernel when freed (a
    front-end's are rare: a file of weights a client sends and gRPC's copies of it, a request of tens of MB);
    smaller blocks still come from the heap as keep_freed_memory set. True if it took."""
    return _set_malloc(((M_MMAP_THRESHOLD, HUGE_BLOCK), (M_MMAP_MAX, MMAP_MAX_DEFAULT)), environ)


def _set_malloc(settings: tuple[tuple[int, int], ...], environ: Mapping[str, str]) -> bool:
    """``mallopt`` each (parameter, value), unless the operator set malloc; True if all took."""
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None or malloc_set_by_operator(environ):
        return False
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def give_back_freed_memory() -> bool:
    """Return the heap's free memory to the kernel now (glibc's ``malloc_trim``): after a rare large request
    whose buffers the heap would otherwise keep for good. True if it gave any back."""
    trim = _libc("malloc_trim", [ctypes.c_size_t])
    return trim is not None and trim(0) == 1


def _libc(name: str, argtypes: list) -> Callable[..., int] | None:
    """The C library's function ``name`` (returning an int), or None where it has none (not glibc)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def malloc_set_by_operator(environ: Mapping[str, str]) -> bool:
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(name in environ for name in OPERATOR_VARIABLES) or any(name in tunables for name in OPERATOR_TUNABLES)
