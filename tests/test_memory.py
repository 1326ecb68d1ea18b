"""The forward pass reuses the host memory it freed (server.memory): counted in page faults, in a fresh process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from resnet_server.common.memory import malloc_set_by_operator
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc malloc's")

# Batch-8 and batch-16 passes on a thread of their own, as a replica's; prints the minor page faults of each pass
# after three warm-up passes, by batch size. "undo" sets glibc to hand freed memory back at once (its starting mmap
# threshold, heaps trimmed at once): the control that shows the count sees faults, and the state keep_freed_memory
# must then mend.
PROBE = """
import ctypes, json, resource, sys, threading
import resnet_server  # its import keeps freed memory (resnet_server.common.memory), before torch comes
import torch
from resnet_server.common.model import build_model, load_weights
from resnet_server.engine.runner import ModelRunner
from resnet_server.common.memory import M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD, keep_freed_memory
from resnet_server.common.threads import use_torch_threads
if sys.argv[1] in ("undo", "undo-then-keep"):
    mallopt, M_MMAP_THRESHOLD = ctypes.CDLL(None).mallopt, -3  # the one parameter server.memory leaves alone
    mallopt(M_ARENA_MAX, 0)  # glibc's default: an arena per thread, up to 8 a core
    mallopt(M_MMAP_MAX, 65536)  # glibc's default: large blocks mapped on their own ...
    mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # ... from M_MMAP_THRESHOLD's starting value up
    mallopt(M_TRIM_THRESHOLD, 0)  # return any free memory at a heap's top
if sys.argv[1] == "undo-then-keep":
    keep_freed_memory()
sbrk = ctypes.CDLL(None).sbrk
sbrk.restype, sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
faults, grown = {}, {}
def passes():
    use_torch_threads(2)
    torch.manual_seed(0)
    runner = ModelRunner(build_model(load_weights("random", torch.device("cpu")), torch.device("cpu")),
                         torch.device("cpu"), "fp32")
    for size in (8, 16):
        batch, temperatures = torch.rand(size, 3, 224, 224), torch.ones(size)
        for index in range(10):
            before, heap_end = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, sbrk(0)
            runner(batch, temperatures)
            if index >= 3:
                faults.setdefault(size, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
                grown.setdefault(size, []).append(sbrk(0) != heap_end)
thread = threading.Thread(target=passes)
thread.start()
thread.join()
print(json.dumps({"kept": resnet_server.KEPT_FREED_MEMORY, "faults": faults, "grown": grown}))
"""


def _probe(mode: str, **environ: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True, env={**os.environ, **environ})
    return json.loads(done.stdout.splitlines()[-1])


def _handed_back(result: dict, size: int) -> list[int]:
    """The faults of the passes at ``size`` that ended with the heap's end where it began. Kept memory still
    grows now and then as the heap settles (a pass's blocks no longer fit where they were and the heap grows by
    one of them: first touches, seen with its end moving), where memory handed back faults every pass, the heap
    no larger for it. Enough such passes must be left for the check to say anything."""
    faults = [count for count, grown in zip(result["faults"][str(size)], result["grown"][str(size)], strict=True)
              if not grown]
    assert len(faults) >= 4, result
    return faults


@pytest.mark.slow
def test_a_forward_pass_faults_in_no_memory_once_warm():
    result = _probe("keep")
    assert result["kept"] is True
    # A batch-8 pass frees and reallocates about 76 MB (19,000 pages) of activations, a batch-16 pass blocks of
    # up to 51 MB, over the largest mmap threshold glibc takes (18,800 pages a pass with only the thresholds set).
    assert max(_handed_back(result, 8)) < 500, result
    assert max(_handed_back(result, 16)) < 500, result


@pytest.mark.slow
def test_keeping_freed_memory_mends_a_heap_that_hands_it_back():
    """Whether glibc's own settings fault depends on the heap's state, so the regime that does is set on purpose:
    the passes then fault (the count can see it), and keep_freed_memory called after it brings them to none."""
    handed_back = _probe("undo")
    assert min(handed_back["faults"]["8"]) > 5_000, handed_back["faults"]
    mended = _probe("undo-then-keep")
    assert max(_handed_back(mended, 8) + _handed_back(mended, 16)) < 500, mended


@pytest.mark.slow
def test_the_operators_own_settings_stand():
    """glibc's environment settings, here the regime that hands memory back: the server leaves malloc be (and
    says so), so the passes fault as the operator asked."""
    operators = _probe("keep", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="0")
    assert operators["kept"] is False
    assert min(operators["faults"]["8"]) > 5_000, operators["faults"]


@pytest.mark.parametrize(("environ", "set_by_operator"), [
    ({}, False),
    ({"MALLOC_CHECK_": "3", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, False),  # others: ours apply
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, True),
    ({"MALLOC_ARENA_MAX": "2"}, True),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=4"}, True),
])
def test_which_settings_are_the_operators(environ, set_by_operator):
    assert malloc_set_by_operator(environ) is set_by_operator


# What a front-end does with a file of weights a client sends: one block of 40 MB (the request's bytes) and 40 MB
# in small blocks (gRPC's), each freed in turn; prints the RSS (MB) at each step, in a fresh process whose malloc
# the server package set.
FRONTEND_PROBE = """
import json, sys
import resnet_server  # keeps freed memory
from resnet_server.common.memory import give_back_freed_memory, map_huge_blocks
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
mapped = map_huge_blocks() if sys.argv[1] == "frontend" else False
steps = {"start": rss()}
block = bytearray(40 << 20)
steps["block"] = rss()
del block
steps["block freed"] = rss()
small = [bytearray(16 << 10) for _ in range(2560)]
steps["small"] = rss()
del small
steps["small freed"] = rss()
give_back_freed_memory()
steps["given back"] = rss()
print(json.dumps({"mapped": mapped, **steps}))
"""


def _frontend_probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", FRONTEND_PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_front_end_hands_back_a_huge_block_when_freed_and_small_ones_when_told():
    front_end, engine = _frontend_probe("frontend"), _frontend_probe("engine")
    assert front_end["mapped"] is True and front_end["block"] - front_end["start"] >= 39
    assert front_end["block freed"] - front_end["start"] <= 2, front_end  # mapped on its own: unmapped when freed
    assert engine["block freed"] - engine["start"] >= 39, engine  # the heap keeps it (keep_freed_memory)
    for steps in (front_end, engine):
        assert steps["small freed"] - steps["start"] >= 38, steps  # the heap keeps freed small blocks ...
        assert steps["given back"] - steps["start"] <= 4, steps  # ... until give_back_freed_memory
