"""What a --workers worker writes into its statistics row, run in spawned processes by test_statistics (a module
of its own, so a spawned process imports this and server.statistics only, not torch)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from resnet_server.common.statistics import BatchTiming, ModelStatistics, SharedRow


@dataclass(frozen=True)
class Answered:
    """One image's result as record_request reads it."""

    queue_seconds: float
    timing: BatchTiming = BatchTiming(0.001, 0.002, 0.0005)


class StuckOutput:
    """A result whose queue time, read inside record_request's write, says so and never comes back."""

    def __init__(self, inside: threading.Event) -> None:
        self._inside = inside

    @property
    def queue_seconds(self) -> float:
        self._inside.set()
        time.sleep(600)
        return 0.0


def record_in_another_process(row: SharedRow, requests: int, stuck: threading.Event | None = None) -> None:
    """A --workers worker's share: ``requests`` requests of two images, one batch each; with ``stuck``, one more
    whose write never ends."""
    statistics = ModelStatistics(8, row)
    for _ in range(requests):
        statistics.record_batch(2, Answered(0).timing)
        statistics.record_request(0.004, [Answered(0.0005), Answered(0.001)])
    if stuck is not None:
        statistics.record_request(0.004, [StuckOutput(stuck)])
