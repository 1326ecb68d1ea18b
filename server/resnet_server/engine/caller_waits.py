"""Waits that hold a batch back for callers expected to send again soon after their answers.

A wait pays off only when the callers do come back; one that runs out says they are not a closed loop, so the next
1, 2, 4, ... (at most MOST_WAITS_SKIPPED) waits are skipped, and each wait they come back for halves that again. A
batcher keeps one ``WaitBackoff`` a kind of wait; each counts its outcomes in ``resnet_caller_waits_total``.
"""

from __future__ import annotations

from typing import Protocol

from resnet_server.common.config import MOST_WAITS_SKIPPED


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class WaitBackoff:
    """When a kind of wait is skipped, and what its waits came to."""

    def __init__(self, came_back: _Counter, ran_out: _Counter) -> None:
        self._came_back, self._ran_out = came_back, ran_out
        self._to_skip = 0
        self._skip_after_ran_out = 1  # waits to skip once the next wait runs out

    def skip(self) -> bool:
        """True (and one fewer to skip) while waits are being skipped after one ran out."""
        if self._to_skip > 0:
            self._to_skip -= 1
            return True
        return False

    def ran_out(self) -> None:
        self._ran_out.inc()
        self._to_skip = self._skip_after_ran_out
        self._skip_after_ran_out = min(2 * self._skip_after_ran_out, MOST_WAITS_SKIPPED)

    def came_back(self) -> None:
        self._came_back.inc()
        self._skip_after_ran_out = max(1, self._skip_after_ran_out // 2)
