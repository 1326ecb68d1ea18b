"""Triton's model statistics, the totals behind the Open Inference Protocol's ``ModelStatistics``.

Triton's clients and ``perf_analyzer`` read these to split a request's time in the server into
queue, input, inference and output. Two writers feed them: each replica's worker thread records
every batch it runs, and the core records every request it answers, so a lock guards them.
A request's queue and compute times are those of its slowest image (it waits for all of them).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class BatchTiming:
    """Seconds one batch spent in each part of its compute."""

    input: float  # converting the batch's inputs (raw tensors, deferred JPEGs) and copying them in
    infer: float  # the forward pass, softmax and the copy back to the CPU
    output: float  # top-k and the per-image results

    @property
    def total(self) -> float:
        return self.input + self.infer + self.output


class TimedOutput(Protocol):
    """What a request's per-image results carry for its statistics."""

    queue_seconds: float
    timing: BatchTiming


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += round(seconds * 1e9)


@dataclass
class BatchTotals:
    """One batch size's executions and their summed times."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def add(self, timing: BatchTiming) -> None:
        self.compute_input.add(timing.input)
        self.compute_infer.add(timing.infer)
        self.compute_output.add(timing.output)


@dataclass
class Totals:
    """Everything ``ModelStatistics`` reports, since the server started."""

    last_inference_ms: int = 0
    inference_count: int = 0  # images answered OK
    execution_count: int = 0  # batches run
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: BatchTotals = field(default_factory=BatchTotals)  # per request, its slowest image's batch
    batches: dict[int, BatchTotals] = field(default_factory=dict)  # by batch size


class ModelStatistics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = Totals()

    def record_batch(self, size: int, timing: BatchTiming) -> None:
        """Called by a replica's worker thread for every batch it computed."""
        with self._lock:
            self._totals.execution_count += 1
            self._totals.last_inference_ms = int(time.time() * 1000)
            self._totals.batches.setdefault(size, BatchTotals()).add(timing)

    def record_request(self, seconds: float, outputs: Sequence[TimedOutput] | None) -> None:
        """One answered request: its results, or None when it was answered with an error."""
        with self._lock:
            if outputs is None:
                self._totals.fail.add(seconds)
                return
            self._totals.success.add(seconds)
            self._totals.inference_count += len(outputs)
            self._totals.queue.add(max(output.queue_seconds for output in outputs))
            self._totals.compute.add(max((output.timing for output in outputs), key=lambda timing: timing.total))

    def snapshot(self) -> Totals:
        with self._lock:
            return copy.deepcopy(self._totals)
