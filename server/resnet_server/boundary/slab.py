"""The shared memory between the front-ends and one engine: a slab of fixed-size slots, one image each.

A front-end takes slots, writes each image's bytes into its slot's input area (once: from the request
straight into shared memory) and sends the engine only the slot numbers. The engine reads the pixels
where they lie and writes each image's probabilities and logits into the same slot's output area; the
front-end reads them back and gives the slot up. The slab has as many slots as ``--max-queue``, so
taking slots *is* the server-wide bound on images accepted and not yet answered: when none is free,
the call is refused at once, whichever front-end took it.

The memory is a memfd (``os.memfd_create``), handed to each process as a file descriptor when it is
spawned. It has no name in /dev/shm, so no exit, not even SIGKILL of every process, can leave a segment
behind, and Python's resource tracker (which unlinks segments other processes still use) never sees it.
Slots are taken under an ``fcntl`` record lock on the memfd, which the kernel drops when its holder dies,
so a front-end killed while taking slots cannot stall the others. Each slot records its owner (a number
the supervisor gives every front-end process it starts), so the slots of a front-end that died can be
found and freed. With ``--fair-share`` on, each slot also records its caller's tag, so that a take can refuse a
caller holding more than its share of the queue (resnet_server.boundary.queue_share).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from resnet_server.boundary.queue_share import check_share
from resnet_server.common.shapes import FLOAT_SHAPE, NUM_CLASSES

FREE = 0
# A front-end process's number (the supervisor's, from 1) is below PROCESS_OWNERS. Each of its connections to an
# engine owns slots under a number of its own, that number plus a multiple of PROCESS_OWNERS (connection_owner):
# the engine's clean-up of a connection that has ended can then never free a slot its next connection took.
PROCESS_OWNERS = 1 << 20
_CONNECTIONS = (1 << 31) // PROCESS_OWNERS  # owners are int32


def connection_owner(process_owner: int, connection: int) -> int:
    """The slab owner of a front-end process's ``connection``-th connection (counting from 0)."""
    return process_owner + (connection % _CONNECTIONS) * PROCESS_OWNERS
RECENT_SLOTS = 64  # slots a process gave back that its next take tries first
# Bytes an image may take in its slot as it came: a 640x480 RGB raw image (921,600) or a JPEG of up to
# 1 MiB. A larger one is preprocessed by its front-end: for a GPU engine to its uint8 crop (147 KiB), for a
# CPU engine to the model's float input (588 KiB).
SLOT_INPUT_BYTES = 1 << 20
FLOAT_INPUT_BYTES = 4 * FLOAT_SHAPE[0] * FLOAT_SHAPE[1] * FLOAT_SHAPE[2]  # the model's float input always fits
OUTPUT_BYTES = 2 * NUM_CLASSES * 4  # float32 probabilities, then logits
_PAGE = mmap.PAGESIZE


def _aligned(size: int, to: int) -> int:
    return -(-size // to) * to


@dataclass(frozen=True)
class SlabLayout:
    """``slots`` slots of ``input_bytes`` (at least the model's float input: raw float32 images and those
    preprocessed for a CPU engine) and the outputs' bytes each."""

    slots: int
    input_bytes: int

    @property
    def slot_bytes(self) -> int:
        return _aligned(self.inline_bytes + OUTPUT_BYTES, 64)

    @property
    def header_bytes(self) -> int:
        return _aligned(8 * self.slots, _PAGE)  # an int32 owner and an int32 caller tag a slot

    @property
    def size(self) -> int:
        return self.header_bytes + self.slots * self.slot_bytes

    @property
    def inline_bytes(self) -> int:
        """The most bytes an image may take in its slot as it came (raw pixels or a JPEG)."""
        return _aligned(max(self.input_bytes, FLOAT_INPUT_BYTES), 64)


def create_slab_memory(layout: SlabLayout) -> int:
    """A new memfd of the layout's size, every slot free (the kernel hands out zeroed pages)."""
    fd = os.memfd_create("resnet-slab", os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.size)
    return fd


class Slab:
    """One process's view of a slab; ``fd`` stays owned by the caller (closing it would drop our locks)."""

    def __init__(self, fd: int, layout: SlabLayout) -> None:
        self.layout = layout
        self._fd = fd
        self._memory = mmap.mmap(fd, layout.size)
        self.owners = np.frombuffer(self._memory, dtype=np.int32, count=layout.slots)
        self.tags = np.frombuffer(self._memory, dtype=np.int32, count=layout.slots, offset=4 * layout.slots)
        self._view = memoryview(self._memory)
        self._owner_of = self._view[:4 * layout.slots].cast("i")  # the same owners, a slot at a time (NumPy's
        # scalar access costs four times as much, and a call's slot is read and written one at a time)
        self._tag_of = self._view[4 * layout.slots:8 * layout.slots].cast("i")
        # Every slot's output area as one strided float32 [slots, 2, 1000] array: a batch's answers are written
        # with one NumPy assignment rather than two copies an image.
        self.outputs = np.ndarray((layout.slots, 2, NUM_CLASSES), dtype=np.float32, buffer=self._memory,
                                  offset=layout.header_bytes + layout.inline_bytes,
                                  strides=(layout.slot_bytes, 4 * NUM_CLASSES, 4))
        # fcntl locks exclude processes, not threads: two front-ends in one process (tests) also need this.
        self._taking = threading.Lock()
        # The slots this process gave back last, newest last. A take tries them before it scans the slab: one
        # check rather than a scan of every slot, and the same few slots, warm in the caches, serve call after call.
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_SLOTS)

    def take(self, count: int, owner: int, tag: int = 0) -> list[int] | None:
        """``count`` free slots, now ``owner``'s, for the caller tagged ``tag``; None (and none taken) when fewer
        are free; ShareExceeded when that caller holds its share of the queue (``tag`` 0: no share checked)."""
        with self._taking:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1)
            try:
                self.check_share(count, tag)
                free = self._recently_freed(count) or np.flatnonzero(self.owners == FREE)[:count].tolist()
                if len(free) < count:
                    return None
                for slot in free:
                    self._owner_of[slot] = owner
                    self._tag_of[slot] = tag
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1)
        return free

    def check_share(self, count: int, tag: int) -> None:
        """ShareExceeded if the caller tagged ``tag`` may not take ``count`` more slots (read without the lock,
        this is what take() would decide a moment ago)."""
        if tag:
            held = self.owners != FREE
            check_share(int(np.count_nonzero(held & (self.tags == tag))), count, self.layout.slots,
                        lambda: len(set(np.unique(self.tags[held]).tolist()) | {tag}))

    def free_count(self) -> int:
        """Slots free now, read without the lock: what take() would find a moment ago."""
        return int(np.count_nonzero(self.owners == FREE))

    def _recently_freed(self, count: int) -> list[int] | None:
        """``count`` of the slots this process gave back last that are still free, or None. Those another
        front-end took meanwhile leave the list (a scan finds them once they are free again); the free ones found
        stay in it when they are too few."""
        free: list[int] = []
        while len(free) < count and self._recent:
            slot = self._recent.pop()
            # A slot can be in twice (freed, taken by another's scan, freed again): the second is not free twice.
            if self._owner_of[slot] == FREE and slot not in free:
                free.append(slot)
        if len(free) < count:
            self._recent.extend(free)
            return None
        return free

    def give_back(self, slots: list[int], owner: int) -> None:
        """Free those of ``slots`` that ``owner`` still holds. No lock: a slot that is ``owner``'s can change
        hands only through this, and takers see either value."""
        for slot in slots:
            if self._owner_of[slot] == owner:
                self._owner_of[slot] = FREE
                self._recent.append(slot)

    def free_all_but(self, processes: set[int]) -> int:
        """Free every slot held by a connection of a front-end process not in ``processes`` (front-ends that
        have ended); how many."""
        gone = (self.owners != FREE) & ~np.isin(self.owners % PROCESS_OWNERS, list(processes))
        self.owners[gone] = FREE
        return int(gone.sum())

    def free_owners(self, owners: set[int]) -> int:
        """Free every slot held by one of ``owners`` (connections known to have ended); how many."""
        gone = np.isin(self.owners, list(owners))
        self.owners[gone] = FREE
        return int(gone.sum())

    @property
    def address(self) -> int:
        """Where this process maps the slab (what a GPU engine registers with CUDA:
        ``resnet_server.engine.registered_slab``)."""
        return np.frombuffer(self._memory, dtype=np.uint8, count=1).ctypes.data

    def input(self, slot: int, nbytes: int) -> memoryview:
        start = self.layout.header_bytes + slot * self.layout.slot_bytes
        return self._view[start:start + nbytes]

    def input_rows(self) -> np.ndarray:
        """Every slot's input area as one strided uint8 [slots, inline bytes] array (the engine gathers a batch's
        images from it with one copy)."""
        rows: np.ndarray = np.ndarray((self.layout.slots, self.layout.inline_bytes), dtype=np.uint8,
                                      buffer=self._memory, offset=self.layout.header_bytes,
                                      strides=(self.layout.slot_bytes, 1))
        return rows

    def output(self, slot: int) -> np.ndarray:
        """float32 [2, 1000]: the slot's probabilities and logits."""
        rows: np.ndarray = self.outputs[slot]
        return rows

    def close(self) -> None:
        del self.owners, self.tags, self.outputs  # views of the memory, which closes only once none is left
        self._owner_of.release()
        self._tag_of.release()
        self._view.release()
        with contextlib.suppress(BufferError):  # a view of it is still held somewhere: it goes with the process
            self._memory.close()
