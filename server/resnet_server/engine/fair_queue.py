"""A device's queue, shared fairly between callers: batches take images round robin over the callers with images
waiting, as many images each a turn as its weight (a deficit round robin counted in images: a turn a batch cuts
short goes on in the next), so a caller with one request in flight waits behind a turn of each other caller, not
behind everything a greedy one has queued. Within a caller, its images go in priority order (Triton's
``priority``: 1 first, then 2, ...; 0 or none after every numbered level), then in the order they came.

Every image of one caller (or of every caller, with ``--fair-share off``: one key, "") goes first in, first out,
as a single queue would.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from resnet_server.common.work import WorkItem

Item = TypeVar("Item", bound=WorkItem)
UNNUMBERED = 1 << 62  # the rank of priority 0 (none asked): after every numbered level


class FairQueue(Generic[Item]):
    """The queued items of every caller (``WorkItem.client``); not thread-safe (the batcher's lock guards it)."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[tuple[int, int, Item]]] = {}  # a heap of (rank, arrival, item) a caller
        self._turns: collections.deque[str] = collections.deque()  # callers with items, the next one first
        self._weights: dict[str, int] = {}  # images a turn, a caller with items (its newest item's weight)
        self._turn_left = 0  # images the first caller in _turns may still take in its turn; 0: its turn starts
        self._arrivals = itertools.count()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Item]:
        """Every queued item, in no particular order."""
        return (item for heap in self._waiting.values() for _, _, item in heap)

    def __contains__(self, item: object) -> bool:
        return isinstance(item, WorkItem) and any(entry[2] is item for entry in self._waiting.get(item.client, ()))

    def extend(self, items: Iterable[Item]) -> None:
        for item in items:
            heap = self._waiting.get(item.client)
            if heap is None:
                heap = self._waiting[item.client] = []
                self._turns.append(item.client)  # a caller new to the queue waits for the turns under way
            self._weights[item.client] = max(1, item.weight)
            heapq.heappush(heap, (item.priority or UNNUMBERED, next(self._arrivals), item))
            self._count += 1

    def take(self, most: int) -> list[Item]:
        """Up to ``most`` items, each caller's turn in turn; a turn cut short goes on next time."""
        taken: list[Item] = []
        while len(taken) < most and self._turns:
            client = self._turns[0]
            heap = self._waiting[client]
            if not self._turn_left:
                self._turn_left = self._weights[client]
            taken.append(heapq.heappop(heap)[2])
            self._turn_left -= 1
            if not heap:
                self._forget(client)
            elif not self._turn_left:
                self._turns.rotate(-1)
        self._count -= len(taken)
        return taken

    def _forget(self, client: str) -> None:
        """``client`` has no item left: out of the turns (its turn, if under way, ends)."""
        if self._turns[0] == client:
            self._turn_left = 0
        self._turns.remove(client)
        del self._waiting[client], self._weights[client]

    def remove(self, item: Item) -> None:
        """Drop one queued item (its caller has gone); ValueError if it is not queued."""
        heap = self._waiting.get(item.client, [])
        index = next((i for i, entry in enumerate(heap) if entry[2] is item), None)
        if index is None:
            raise ValueError("the item is not queued")
        heap[index] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        self._count -= 1
        if not heap:
            self._forget(item.client)

    def oldest_arrival(self) -> float:
        """The earliest ``enqueued`` time of the items queued (the queue must not be empty)."""
        return min(item.enqueued for item in self)

    def arrived_since(self, moment: float) -> int:
        """How many queued items were made at ``moment`` or later."""
        return sum(item.enqueued >= moment for item in self)

    def callers(self) -> int:
        """How many callers have items queued."""
        return len(self._turns)

    def holds(self, client: str) -> bool:
        """Whether ``client`` has items queued."""
        return client in self._waiting
