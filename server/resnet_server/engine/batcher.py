"""Dynamic batching for one device: a bounded queue of images and the worker thread that drains it.

The engine's reader calls :meth:`Batcher.submit` (never blocks; the slab's slots bound the queue). The worker thread
takes whatever is waiting, up to ``max_batch_size``, and runs it at once: a lone request pays no batching delay, and
under load batches grow by themselves while the previous batch computes. ``max_batch_delay_ms`` lets the worker wait
for a fuller batch, but never past that long after the oldest waiting image arrived. ``wait_for_callers_ms`` lets it
wait, after answering a batch, for as many new images as that batch held: a closed loop's callers send again one
round trip after their answers, and without the wait they split into two batches that take turns (sixteen callers:
two batches of eight, each computing while the other's callers are away). A wait that runs out says the callers are
not such a loop, and the next batches start at once. With callers told apart (resnet_server.engine.fair_queue), a
batch the others already fill waits as briefly for a caller just answered, so that its next call takes its turn in
it. Cancelled and expired images are dropped before compute.
Results go where its ``Answers`` say: in an engine process (``resnet_server.engine.core``), to shared memory and the
front-end that sent each image.

A batcher whose batches fail ``failures_before_eviction`` times in a row is out of rotation (the router sends it
nothing). Every ``probe_interval`` seconds its worker then runs one blank image through the forward pass, and the
first probe that passes brings it back: a transient fault costs no user request after the eviction, and a device
that stays broken stays out.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from resnet_server.common.errors import ComputeFailed, DeadlineExpired, Overloaded, ServingError, Unavailable
from resnet_server.common.metrics import Metrics
from resnet_server.common.postprocess import top_k
from resnet_server.common.shapes import FLOAT_SHAPE
from resnet_server.common.statistics import BatchTiming
from resnet_server.common.threads import use_torch_threads
from resnet_server.common.work import WorkItem
from resnet_server.engine.batch_metrics import BatchMetrics
from resnet_server.engine.caller_waits import WaitBackoff
from resnet_server.engine.fair_queue import FairQueue
from resnet_server.engine.runner import PendingScores

if TYPE_CHECKING:
    from resnet_server.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# The longest a batch waits for a caller whose turn would be lost, as a share of the last batch's forward pass: a
# caller with one call in flight sends again one round trip after its answer, and the others lose at most this share
# of the device's time to the wait.
TURN_WAIT_SHARE = 0.05


@dataclass(frozen=True)
class BatchOutput:
    """A batch's results on the CPU, row i for the batch's item i (NumPy views of one host tensor)."""

    probabilities: np.ndarray  # float32 [B, 1000], softmax(logits / T)
    logits: np.ndarray  # float32 [B, 1000], before temperature
    top_k: list[list[tuple[int, float]]]
    queue_seconds: list[float]
    timing: BatchTiming  # the batch's compute, in parts
    weights_version: int  # of the weights that computed it
    number: int = 0  # the batch's number on this device, counted from 1
    buckets: tuple[int, ...] = ()  # the sizes it ran at (runner.run_sizes)


@dataclass(frozen=True)
class Answers:
    """Where a batcher's answers go (an engine's: its front-ends' slots and sockets, resnet_server.engine.core),
    called on the batcher's threads: ``deliver(items, their outputs)``, ``fail(items, the error that fails them)``, and
    ``dropped(items)`` for cancelled items left out of a batch."""

    deliver: Callable[[list[WorkItem], BatchOutput], None]
    fail: Callable[[list[WorkItem], BaseException], None]
    dropped: Callable[[list[WorkItem]], None]


# (inputs [B, 3, 224, 224] on the CPU or the device, temperatures [B]) -> (probabilities, logits), [B, 1000] on the
# CPU, when PendingScores.wait() returns.


@dataclass(eq=False)
class _Launched:
    """A launched batch, until it is answered: its scores on their way, or why it could not start."""

    batch: list[WorkItem]
    started: float  # time.monotonic() when the worker took it
    prepared: float = 0.0
    scores: PendingScores | None = None
    error: BaseException | None = None
    weights_version: int = 0
    number: int = 0


@dataclass(eq=False)
class _Swap:
    """New weights to put in place between two batches, on the worker's thread (see Batcher.swap)."""

    action: Callable[[], None]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Batcher:
    """``setup`` runs first on the worker thread and returns the model runner. Loading, warm-up
    and every forward pass thus share one thread: with OpenMP, each thread that runs parallel torch
    ops gets its own team of spinning workers, and on a small CPU two teams slow both (resnet_server.common.threads).

    The worker forms, prepares and launches batches; on CUDA a finisher thread waits for each one's scores,
    takes its top-k and hands the answers back. A launch there returns while the device still computes, so the
    worker gathers and uploads the next batch meanwhile (in series, the host work took longer than the forward
    pass it waited on: docs/performance.md, "Figures behind the code"). At most
    the runner's ``batches_in_flight`` batches are launched and unanswered, and the next batch is formed only when
    there is room for it, so it still takes everything that arrived in the meantime. On the CPU, where the
    forward pass itself occupies the cores, the worker answers each batch itself before it takes the next."""

    def __init__(self, name: str, setup: Callable[[], ModelRunner], metrics: Metrics, *, max_batch_size: int,
                 max_batch_delay_ms: float, failures_before_eviction: int, probe_interval: float,
                 on_rejoin: Callable[[], None], answers: Answers, wait_for_callers_ms: float = 0.0) -> None:
        self.name = name
        # Answering runs on the worker's and the finisher's threads: a failure there fails those items, never
        # the thread (a dead finisher would leave the device looking alive and answering nothing).
        self._fail = self._guarded(answers.fail)
        self._deliver = self._guarded(answers.deliver, self._fail)
        self._on_dropped = self._guarded(answers.dropped)
        self._setup = setup
        self._loaded: ModelRunner | None = None  # set up on the worker's thread, before any batch
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self.max_batch_size = max_batch_size
        self._max_delay = max_batch_delay_ms / 1000.0
        self._wait_for_callers = wait_for_callers_ms / 1000.0
        self._answered = 0  # images in the last batch answered
        self._answered_at = 0.0  # time.monotonic() just before they were handed back
        self._answered_callers: frozenset[str] = frozenset()  # their callers (WorkItem.client)
        self._last_forward = 0.0  # seconds the last batch answered took to compute
        self._queue: FairQueue[WorkItem] = FairQueue()
        self._swaps: list[_Swap] = []  # guarded by _cond
        self.weights_version = 1  # of the weights the next batch runs with: set only on the worker's thread
        self._launches = 0  # batches launched (on the worker's thread)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"batcher-{name}", daemon=True)
        self._finisher = threading.Thread(target=self._finish_batches, name=f"finisher-{name}", daemon=True)
        self._launched: queue.SimpleQueue[_Launched | None] = queue.SimpleQueue()
        self._in_flight = 0  # batches launched and not yet answered; guarded by _cond
        self._launch_times: collections.deque[float] = collections.deque()  # theirs, oldest first; under _cond
        self._left_rotation_at: float | None = None  # time.monotonic() when it last left the rotation
        self._most_in_flight = 1  # set from the runner's device once it is set up
        self.consecutive_failures = 0
        self._failures_before_eviction = failures_before_eviction
        self._probe_interval = probe_interval  # 0: an evicted batcher stays out
        self._next_probe = 0.0  # time.monotonic() of the next probe while out of rotation
        self._on_rejoin = on_rejoin  # called on the worker thread when a probe brings it back
        self._recorded = BatchMetrics(name, metrics)
        came_back, ran_out = self._recorded.wait_came_back, self._recorded.wait_ran_out
        self._loop_waits = WaitBackoff(came_back, ran_out)  # --wait-for-callers-ms
        self._turn_waits = WaitBackoff(came_back, ran_out)  # for a caller's turn (see _wait_for_a_turn_taker)

    @property
    def in_rotation(self) -> bool:
        return self.consecutive_failures < self._failures_before_eviction

    def unanswered_for(self) -> float:
        """Seconds the oldest launched batch has waited for its answer; 0 when none waits."""
        with self._cond:
            oldest = self._launch_times[0] if self._launch_times else None
        return 0.0 if oldest is None else time.monotonic() - oldest

    def out_of_rotation_for(self) -> float:
        """Seconds since the batcher left the rotation; 0 while in it."""
        left = self._left_rotation_at
        return 0.0 if left is None or self.in_rotation else time.monotonic() - left

    def _guarded(self, answer: Callable, fallback: Callable | None = None) -> Callable:
        """``answer`` made safe to call on the batcher's threads: if it raises, the error is logged and the items
        are failed through ``fallback`` (where given, guarded itself), which answers only items not answered yet."""
        def call(items: list[WorkItem], *args) -> None:
            try:
                answer(items, *args)
            except Exception:
                log.exception("answering %d images on %s failed", len(items), self.name)
                if fallback is not None:
                    fallback(items, ComputeFailed(f"answering failed on {self.name}"))
        return call

    def start(self) -> None:
        """Start the worker and wait until its setup is done (re-raising any setup error)."""
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            raise self._setup_error

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish what is queued, and join the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue items; the queue needs no bound of its own, as each item holds one of the slab's --max-queue slots."""
        with self._cond:
            if self._stopping:
                raise Unavailable("server is shutting down")
            self._queue.extend(items)
            self._recorded.queued(len(self._queue))
            self._cond.notify()

    def use_runner(self, runner: ModelRunner) -> None:
        """Run every later batch on ``runner`` (in a swap: on the worker's thread, between two batches)."""
        self._loaded = runner

    @property
    def _runner(self) -> ModelRunner:
        if self._loaded is None:
            raise RuntimeError(f"the model of {self.name} is not loaded")
        return self._loaded

    def withdraw(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Free the queue slots of a cancelled call's items that have not been taken yet; those items."""
        with self._cond:
            waiting = [item for item in items if item in self._queue]
            for item in waiting:
                self._queue.remove(item)
            self._recorded.queued(len(self._queue))
        if waiting:
            self._recorded.dropped("cancelled", len(waiting))
        return waiting

    def _run(self) -> None:
        try:
            self._loaded = self._setup()
            self._most_in_flight = self._loaded.batches_in_flight
        except BaseException as exc:  # handed to start(), which re-raises it in the caller
            self._setup_error = exc
            return
        finally:
            self._ready.set()
        self._finisher.start()
        while (batch := self._next_batch()) is not None:
            if self._swaps:
                self._swap_weights()
            if not batch:  # weights to swap, or out of rotation, no work, and the time to probe has come
                if self._probe_due():
                    self._probe()
                continue
            live = self._drop_dead(batch)
            if live:
                self._launch(live)
        self._launched.put(None)  # after every batch launched: the finisher answers them all, then ends
        self._finisher.join()

    def _next_batch(self) -> list[WorkItem] | None:
        """Block until there is room for a batch and work arrives; None once stopping with nothing left;
        [] when a probe is due."""
        with self._cond:
            while True:
                while self._in_flight >= self._most_in_flight:
                    self._cond.wait()
                while not self._queue and not self._stopping:
                    if self._swaps or not self._cond.wait(self._time_to_probe()):
                        return []
                if not self._queue:
                    return None
                if self._max_delay > 0:
                    self._wait_for_fuller_batch()
                if self._wait_for_callers > 0:
                    self._wait_for_answered_callers()
                self._wait_for_a_turn_taker()
                if self._queue:  # else every image waited for was withdrawn meanwhile: wait for work again
                    break
            batch = self._queue.take(self.max_batch_size)
            self._recorded.queued(len(self._queue))
            return batch

    def swap(self, action: Callable[[], None], version: int, timeout: float) -> None:
        """Run ``action`` (it puts new weights in place) on the worker's thread between two batches, so that no
        batch mixes versions; every batch launched after it is answered as ``version``. Raises what the action
        raised, or TimeoutError if the worker did not get to it within ``timeout`` seconds."""
        swap = _Swap(action, version)
        with self._cond:
            self._swaps.append(swap)
            self._cond.notify_all()
        if not swap.done.wait(timeout):
            raise TimeoutError(f"replica {self.name} did not reach a pause between batches in {timeout:g}s")
        if swap.error is not None:
            raise swap.error

    def _swap_weights(self) -> None:
        with self._cond:
            swaps, self._swaps = self._swaps, []
        for swap in swaps:
            try:
                swap.action()
                self.weights_version = swap.version
            except Exception as exc:  # noqa: BLE001 - handed to the caller of swap(), which says why it failed
                swap.error = exc
            swap.done.set()

    def _probe_due(self) -> bool:
        return not self.in_rotation and bool(self._probe_interval) and time.monotonic() >= self._next_probe

    def _time_to_probe(self) -> float | None:
        """Seconds until the next probe is due; None (wait for work alone) while in rotation or not probing."""
        if self.in_rotation or not self._probe_interval:
            return None
        return max(0.0, self._next_probe - time.monotonic())

    def _probe(self) -> None:
        """One blank image through the forward pass, as a batch would go; passing brings the batcher back."""
        with self._cond:  # a probe judges the device alone, once every batch launched before it is answered
            while self._in_flight:
                self._cond.wait()
        try:
            self._compute_split_on_oom(torch.zeros((1, *FLOAT_SHAPE)), torch.ones(1, dtype=torch.float64)).wait()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the replica out; the next probe decides again
            self._recorded.probed(passed=False)
            self._next_probe = time.monotonic() + self._probe_interval
            log.warning("replica %s failed its probe (%s: %s); next probe in %gs", self.name, type(exc).__name__,
                        exc, self._probe_interval)
            return
        self._recorded.probed(passed=True)
        self._batch_passed()

    def _batch_passed(self) -> None:
        rejoining = not self.in_rotation
        self.consecutive_failures = 0
        if rejoining:
            log.warning("replica %s is back in rotation", self.name)
            self._on_rejoin()

    def _batch_failed(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures == self._failures_before_eviction:
            self._left_rotation_at = time.monotonic()
            self._next_probe = time.monotonic() + self._probe_interval
            log.error("replica %s leaves the rotation after %d failed batches in a row%s", self.name,
                      self.consecutive_failures,
                      f"; probing it every {self._probe_interval:g}s" if self._probe_interval else "")

    def _wait_while(self, short: Callable[[], bool], until: float) -> bool:
        """Wait for more work while ``short()``, not past ``until`` (a time.monotonic() value) nor past stopping;
        True if the wait ran out."""
        while short() and not self._stopping:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return True
            self._cond.wait(remaining)
        return False

    def _batch_short(self) -> bool:
        return len(self._queue) < self.max_batch_size

    def _wait_for_fuller_batch(self) -> None:
        self._wait_while(self._batch_short, self._queue.oldest_arrival() + self._max_delay)

    def _wait_for_answered_callers(self) -> None:
        """Until as many images have come since the last answer as it held, the batch is full, or
        ``wait_for_callers_ms`` after that answer: at most that long a batch, and for traffic whose
        callers do not come back about once in MOST_WAITS_SKIPPED + 1 batches."""
        wait_until = self._answered_at + self._wait_for_callers
        # Only a wait that holds a batch back counts: work arriving after an idle spell finds it over already.
        if not self._callers_missing() or time.monotonic() >= wait_until or self._loop_waits.skip():
            return
        self._wait_and_count(self._loop_waits, self._callers_missing, wait_until)

    def _wait_and_count(self, backoff: WaitBackoff, short: Callable[[], bool], until: float) -> None:
        if self._wait_while(short, until):
            backoff.ran_out()
        elif not self._stopping:  # a wait cut short by shutdown says nothing about the callers
            backoff.came_back()

    def _callers_missing(self) -> bool:
        """Fewer images have come since the last answer than it held, and the batch is not full."""
        return self._batch_short() and self._queue.arrived_since(self._answered_at) < self._answered

    def _wait_for_a_turn_taker(self) -> None:
        """With callers told apart (``--fair-share``): when the queue already fills a batch, by fewer callers than
        it has places, wait a little for a caller just answered that has nothing queued. Its next call comes one
        round trip after its answer; taken now, the batch would go to the others and that caller would wait for
        it to compute and then for its own (a caller with one call in flight: two batches, not one)."""
        wait_until = self._answered_at + TURN_WAIT_SHARE * self._last_forward
        if not self._turn_taker_missing() or time.monotonic() >= wait_until or self._turn_waits.skip():
            return
        self._wait_and_count(self._turn_waits, self._turn_taker_missing, wait_until)

    def _turn_taker_missing(self) -> bool:
        queue = self._queue
        return (len(queue) >= self.max_batch_size and queue.callers() < self.max_batch_size
                and any(not queue.holds(caller) for caller in self._answered_callers))

    def _drop_dead(self, batch: list[WorkItem]) -> list[WorkItem]:
        now = time.monotonic()
        live: list[WorkItem] = []
        expired: list[WorkItem] = []
        cancelled: list[WorkItem] = []
        for item in batch:
            reason = item.is_dead(now)
            if reason is None:
                live.append(item)
                continue
            self._recorded.dropped(reason)
            (expired if reason == "deadline" else cancelled).append(item)
        if expired:
            self._fail(expired, DeadlineExpired("deadline passed while the image waited in the queue"))
        if cancelled:
            self._on_dropped(cancelled)
        return live

    def _launch(self, batch: list[WorkItem]) -> None:
        """Prepare the batch and start its forward pass; it is answered in launch order (on CUDA by the
        finisher). A failure here is answered the same way, so every batch's outcome is counted in one place."""
        self._launches += 1
        launched = _Launched(batch, time.monotonic(), weights_version=self.weights_version, number=self._launches)
        try:
            launched.batch, inputs = self._prepare(batch)
            if not launched.batch:  # every image was refused: each has had its answer
                return
            launched.prepared = time.monotonic()
            # Through NumPy: torch.tensor from a list costs twice as much, once a batch.
            temperatures = torch.from_numpy(np.array([item.temperature for item in launched.batch], np.float64))
            launched.scores = self._compute_split_on_oom(inputs, temperatures)
        except Exception as exc:  # noqa: BLE001 - anything at all fails this batch, never the worker
            launched.error = exc
        with self._cond:
            self._in_flight += 1
            self._launch_times.append(launched.started)
            self._recorded.in_flight(self._in_flight)
        if self._most_in_flight == 1:  # nothing to overlap (the CPU): answered here, with no hand-off
            self._settle(launched)
        else:
            self._launched.put(launched)

    def _finish_batches(self) -> None:
        use_torch_threads(1)  # top-k only: no OpenMP team of its own beside the worker's
        while (launched := self._launched.get()) is not None:
            self._settle(launched)

    def _settle(self, launched: _Launched) -> None:
        """Answer a launched batch and make room for the next."""
        try:
            self._finish(launched)
        except Exception:  # answers are guarded; this is anything else (a metric, say): the thread goes on
            log.exception("finishing a batch of %d on %s failed", len(launched.batch), self.name)
            self._fail(launched.batch, ComputeFailed(f"inference failed on {self.name}"))  # those not answered
        with self._cond:
            self._in_flight -= 1
            self._launch_times.popleft()
            self._recorded.in_flight(self._in_flight)
            self._cond.notify_all()

    def _finish(self, launched: _Launched) -> None:
        batch = launched.batch
        try:
            output = self._output(launched)
        except ServingError as exc:
            self._fail(batch, exc)
            return
        except Exception:  # anything at all: a failure here must fail the batch, never end the finisher
            self._batch_failed()
            ids = sorted({item.request_id for item in batch})
            log.exception("batch of %d on %s failed (requests %s)", len(batch), self.name, ", ".join(ids))
            self._fail(batch, ComputeFailed(f"inference failed on {self.name} (request id {ids[0]})"))
            return
        self._batch_passed()
        self._recorded.answered(output.queue_seconds, self._runner.padding_for(len(batch)), output.timing)
        with self._cond:
            self._answered, self._answered_at = len(batch), time.monotonic()
            self._answered_callers = frozenset(item.client for item in batch)
            self._last_forward = output.timing.infer
        self._deliver(batch, output)

    def _output(self, launched: _Launched) -> BatchOutput:
        """The launched batch's results, once on the host; its launch's error if it had one."""
        if launched.error is not None:
            raise launched.error
        batch = launched.batch
        assert launched.scores is not None  # a batch launched without an error has its scores on their way
        probabilities, logits = launched.scores.wait()
        computed = time.monotonic()
        if len(probabilities) != len(batch):
            raise RuntimeError(f"compute returned {len(probabilities)} results for {len(batch)} images")
        tops = top_k(probabilities, [item.top_k for item in batch])
        timing = BatchTiming(launched.prepared - launched.started, computed - launched.prepared,
                             time.monotonic() - computed)
        # NumPy views of the host results: indexing a row is then plain Python work, not a torch call per image.
        return BatchOutput(probabilities.numpy(), logits.numpy(), tops,
                           [launched.started - item.enqueued for item in batch], timing, launched.weights_version,
                           launched.number, tuple(self._runner.run_sizes(len(batch))))

    def _prepare(self, batch: list[WorkItem]) -> tuple[list[WorkItem], torch.Tensor]:
        """Stack the batch's inputs, decoding deferred JPEGs; an image that cannot be decoded fails alone."""
        inputs, rejected = self._runner.prepare([item.model_input for item in batch])
        for index, error in rejected.items():
            self._fail([batch[index]], error)
        return [item for i, item in enumerate(batch) if i not in rejected], inputs

    def _compute_split_on_oom(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> PendingScores:
        """Launch the batch; on device out-of-memory (raised at launch, when memory is allocated), run it
        in halves, one after the other, before giving up."""
        try:
            return self._runner.launch(inputs, temperatures)
        except torch.OutOfMemoryError:
            if len(inputs) == 1:
                raise Overloaded(f"out of memory on {self.name} even for a single image") from None
            log.warning("out of memory on %s with a batch of %d; splitting it", self.name, len(inputs))
            half = len(inputs) // 2
            first = self._compute_split_on_oom(inputs[:half], temperatures[:half]).wait()
            second = self._compute_split_on_oom(inputs[half:], temperatures[half:]).wait()
            return PendingScores(torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
