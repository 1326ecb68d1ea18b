"""How much of a device's queue (its slab's slots, ``--max-queue``) one caller may hold while others want some,
with ``--fair-share`` on: the engine's turns (resnet_server.engine.fair_queue) share the device's time, and this
keeps a greedy caller from filling the queue so that the others' calls are refused before they could take a turn.

A caller holding nothing may always take free slots, as may one holding at most a sixteenth of them (the floor).
Beyond that, a caller alone may fill all but the floor's worth, kept free for whoever comes next, and with
others holding slots it may hold at most its part of them (the slots divided among the callers holding any, and
never less than the floor). So as the queue fills, the caller holding the most of it is the first refused.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

FLOOR_PART = 16  # the floor is this part of the queue


class ShareExceeded(Exception):
    """A caller asked for more of the queue than its share; the slots it holds, its share, the callers holding."""

    def __init__(self, held: int, limit: int, callers: int, slots: int) -> None:
        if callers == 1:
            why = f"all one caller may: the queue's last {slots - limit} kept for other callers"
        else:
            why = f"over its share of {limit} with {callers} callers queued"
        super().__init__(f"holds {held} images, {why}")
        self.held, self.limit, self.callers = held, limit, callers


def floor(slots: int) -> int:
    return max(1, slots // FLOOR_PART)


def share_limit(slots: int, callers: int) -> int:
    """The most one caller may hold while ``callers`` callers (itself among them) hold slots."""
    if callers <= 1:
        return slots - floor(slots)
    return max(floor(slots), slots // callers)


def check_share(held: int, count: int, slots: int, callers: Callable[[], int]) -> None:
    """Raise ShareExceeded if a caller holding ``held`` slots may not take ``count`` more; ``callers()`` counts
    the callers holding slots, itself included (asked only where the floor does not settle it)."""
    if held == 0 or held + count <= floor(slots):
        return
    holding = callers()
    limit = share_limit(slots, holding)
    if held + count > limit:
        raise ShareExceeded(held, limit, holding, slots)


@functools.lru_cache(maxsize=4096)
def caller_tag(key: str) -> int:
    """A caller's number in the slab's tag column: a 31-bit digest of its key, never 0 (0: no fair share)."""
    if not key:
        return 0
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") & 0x7FFFFFFF or 1
