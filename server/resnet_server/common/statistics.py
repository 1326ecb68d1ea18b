"""Triton's model statistics, the totals behind the Open Inference Protocol's ``ModelStatistics``.

Triton's clients and ``perf_analyzer`` read these to split a request's time in the server into
queue, input, inference and output. Two writers feed them: each replica's worker thread records
every batch it runs, and the core records every request it answers, so a lock guards them.
A request's queue and compute times are those of its slowest image (it waits for all of them).

The totals are one row of int64 counters per server process: the front-ends record requests, the engines
batches. The rows of all processes lie in one block of shared memory that the supervisor made
(:func:`shared_rows`), so whichever front-end takes a ``ModelStatistics`` call answers for the whole server,
as Triton's one process does, and a process that is replaced hands its row, counts intact, to the next one.
Each process writes only its own row; a sibling reads it between two writes, told by the row's sequence
number (odd while a write is under way; a seqlock). Stores reach memory in program order on x86-64, so a
read is exact there; on a weakly ordered CPU (ARM) a read racing a write can, rarely, mix one record's old
and new values.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray
from typing import NamedTuple, Protocol

import numpy as np

# One process's row: these counters, then (count, ns) pairs.
SEQUENCE, LAST_INFERENCE_MS, INFERENCE_COUNT, EXECUTION_COUNT = 0, 1, 2, 3
SUCCESS, FAIL, QUEUE = 4, 6, 8  # each a (count, ns) pair
COMPUTE = 10  # per request, its slowest image's batch: input, infer and output, three pairs
BATCHES = 16  # then the same three pairs for every batch size from 1 to the largest
PARTS = 6
SETTLE_SECONDS = 0.1  # how long a reader waits for a sibling's write to end (its writer may have been killed)


class BatchTiming(NamedTuple):
    """Seconds one batch spent in each part of its compute (the parts in order: the metrics iterate them)."""

    input: float  # converting the batch's inputs (raw tensors, deferred JPEGs) and copying them in
    infer: float  # the forward pass, softmax and the copy back to the CPU
    output: float  # top-k and the per-image results

    @property
    def total(self) -> float:
        return self.input + self.infer + self.output


class TimedOutput(Protocol):
    """What a request's per-image results carry for its statistics."""

    @property
    def queue_seconds(self) -> float: ...

    @property
    def timing(self) -> BatchTiming: ...


@dataclass(frozen=True)
class Duration:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True)
class BatchTotals:
    """Executions and their summed times, for one batch size or for requests."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(frozen=True)
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


def row_width(largest_batch: int) -> int:
    return BATCHES + PARTS * largest_batch


def _batch_at(size: int) -> int:
    """Where batch size ``size``'s three pairs start in a row."""
    return BATCHES + PARTS * (size - 1)


def shared_rows(processes: int, largest_batch: int) -> ctypes.Array:
    """Zeroed rows for ``processes`` server processes in shared memory, to hand to spawned workers."""
    return RawArray(ctypes.c_int64, processes * row_width(largest_batch))


@dataclass(frozen=True)
class SharedRow:
    """A worker's place in the supervisor's shared rows."""

    rows: ctypes.Array
    index: int


class ModelStatistics:
    def __init__(self, largest_batch: int, shared: SharedRow | None = None) -> None:
        width = row_width(largest_batch)
        rows, index = (shared.rows, shared.index) if shared else ((ctypes.c_int64 * width)(), 0)
        # For reading: summed in one go.
        self._table = np.frombuffer(memoryview(rows), dtype=np.int64).reshape(-1, width)
        # For writing, the row's cells through a memoryview: the core records on the event loop, and this is
        # about half the cost of NumPy's scalar item access.
        self._cells = memoryview(rows).cast("B").cast("q")[index * width:(index + 1) * width]
        self._index = index
        self._lock = threading.Lock()
        self._cells[SEQUENCE] += self._cells[SEQUENCE] % 2  # a predecessor killed mid-write left it odd
        self._writing = _RowWrite(self._cells, self._lock)

    def record_batch(self, size: int, timing: BatchTiming) -> None:
        """Called by a replica's worker thread for every batch it computed."""
        with self._writing as row:
            row[EXECUTION_COUNT] += 1
            row[LAST_INFERENCE_MS] = int(time.time() * 1000)
            _add_compute(row, _batch_at(size), timing)

    def record_request(self, seconds: float, outputs: Sequence[TimedOutput] | None) -> None:
        """One answered request: its results, or None when it was answered with an error."""
        with self._writing as row:
            if outputs is None:
                _add(row, FAIL, seconds)
                return
            _add(row, SUCCESS, seconds)
            row[INFERENCE_COUNT] += len(outputs)
            _add(row, QUEUE, max(output.queue_seconds for output in outputs))
            _add_compute(row, COMPUTE, max((output.timing for output in outputs), key=lambda timing: timing.total))

    def snapshot(self) -> Totals:
        """This server's totals: this process's row, plus its sibling front-ends' and engines' (waits up to
        SETTLE_SECONDS for a sibling's write to end, so call it off the event loop)."""
        with self._lock:
            rows = [self._table[self._index].copy()]
        rows += [_settled(row) for index, row in enumerate(self._table) if index != self._index]
        return _totals(np.sum(rows, axis=0), max(int(row[LAST_INFERENCE_MS]) for row in rows))


class _RowWrite:
    """``with`` it: the row's cells, its sequence odd meanwhile (a sibling reading the row waits). One object,
    entered again and again: a generator-based context manager would make a generator every call, on the event
    loop."""

    __slots__ = ("_cells", "_lock")

    def __init__(self, cells: memoryview, lock: threading.Lock) -> None:
        self._cells, self._lock = cells, lock

    def __enter__(self) -> memoryview:
        self._lock.acquire()
        self._cells[SEQUENCE] += 1
        return self._cells

    def __exit__(self, *exc_info) -> None:
        self._cells[SEQUENCE] += 1
        self._lock.release()


def _add(row: memoryview, at: int, seconds: float) -> None:
    row[at] += 1
    row[at + 1] += round(seconds * 1e9)


def _add_compute(row: memoryview, at: int, timing: BatchTiming) -> None:
    _add(row, at, timing.input)
    _add(row, at + 2, timing.infer)
    _add(row, at + 4, timing.output)


def _settled(row: np.ndarray) -> np.ndarray:
    """A copy of a sibling's row taken between two of its writes; after SETTLE_SECONDS, as it stands (a writer
    killed mid-write leaves its sequence odd until its replacement starts: at most that record is partial)."""
    give_up_at = time.monotonic() + SETTLE_SECONDS
    while True:
        sequence = int(row[SEQUENCE])
        copy = row.copy()
        if (sequence % 2 == 0 and int(row[SEQUENCE]) == sequence) or time.monotonic() > give_up_at:
            return copy
        time.sleep(0)  # let the sibling's writer run, should it share this core


def _totals(summed: np.ndarray, last_inference_ms: int) -> Totals:
    def duration(at: int) -> Duration:
        return Duration(int(summed[at]), int(summed[at + 1]))

    def compute(at: int) -> BatchTotals:
        return BatchTotals(duration(at), duration(at + 2), duration(at + 4))

    largest_batch = (len(summed) - BATCHES) // PARTS
    sizes = [size for size in range(1, largest_batch + 1) if summed[_batch_at(size)]]
    return Totals(
        last_inference_ms=last_inference_ms, inference_count=int(summed[INFERENCE_COUNT]),
        execution_count=int(summed[EXECUTION_COUNT]), success=duration(SUCCESS), fail=duration(FAIL),
        queue=duration(QUEUE), compute=compute(COMPUTE),
        batches={size: compute(_batch_at(size)) for size in sizes},
    )
