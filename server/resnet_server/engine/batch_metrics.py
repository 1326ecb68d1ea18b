"""What one device's batcher records of its work: Prometheus' series for that device and Triton's statistics.

The batcher says what happened (a queue's depth, a batch answered, images dropped, a probe's outcome); this
module knows which series each fact goes to, so the batcher holds no metric of its own."""

from __future__ import annotations

from collections.abc import Sequence

from resnet_server.common.metrics import Metrics
from resnet_server.common.statistics import BatchTiming


class BatchMetrics:
    """The series of device ``name``, each labelled once."""

    def __init__(self, name: str, metrics: Metrics) -> None:
        self._name = name
        self._queue_depth = metrics.queue_depth.labels(name)
        self._batches_in_flight = metrics.batches_in_flight.labels(name)
        self._queue_wait = metrics.queue_wait.labels(name)
        self._compute_time = metrics.compute.labels(name)
        self._part_seconds = tuple(metrics.batch_part.labels(name, part) for part in BatchTiming._fields)
        self._batch_size = metrics.batch_size.labels(name)
        self._padded = metrics.padded.labels(name)
        self._dropped = metrics.dropped
        self._probes = metrics.probes
        self._statistics = metrics.statistics
        self.wait_came_back, self.wait_ran_out = (metrics.caller_waits.labels(name, outcome)
                                                  for outcome in ("came_back", "ran_out"))

    def queued(self, images: int) -> None:
        self._queue_depth.set(images)

    def in_flight(self, batches: int) -> None:
        self._batches_in_flight.set(batches)

    def dropped(self, reason: str, images: int = 1) -> None:
        """Images dropped before compute: their deadline passed, or their callers cancelled."""
        self._dropped.labels(self._name, reason).inc(images)

    def probed(self, passed: bool) -> None:
        self._probes.labels(self._name, "passed" if passed else "failed").inc()

    def answered(self, queued_seconds: Sequence[float], padding: int, timing: BatchTiming) -> None:
        """A batch computed and answered: each image's wait in the queue, the images it was padded with, and
        its compute in parts."""
        self._batch_size.observe(len(queued_seconds))
        self._padded.inc(padding)
        self._compute_time.observe(timing.total)
        for counter, seconds in zip(self._part_seconds, timing, strict=True):
            counter.inc(seconds)
        self._statistics.record_batch(len(queued_seconds), timing)
        for seconds in queued_seconds:
            self._queue_wait.observe(seconds)
