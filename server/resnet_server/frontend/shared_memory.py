"""The system shared-memory regions as one front-end holds them, and tensors read from and written to them.

A region is an open descriptor of its file under /dev/shm, read with ``preadv`` and written with ``pwrite``,
never mapped: a file its client truncates after registering then fails the request that reads past its end
with INVALID_ARGUMENT, where a mapping would have been a SIGBUS that ends this process. An image's pixels go
from the file straight into its slab slot (``RegionBytes.read_into``): one copy, none through gRPC.

Every front-end opens every region the supervisor's table holds (``resnet_server.common.shared_regions``), so a client's
next connection may land on any of them. Unregistering takes a region out of the table at once; a request that
is using it finishes with it, and its descriptor is closed when the last such request is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator

import numpy as np

from resnet_server.common.errors import InvalidInput
from resnet_server.common.shared_regions import SHM_FOLDER, RegionSpec, shm_name

log = logging.getLogger(__name__)


def open_region(spec: RegionSpec) -> int:
    """A descriptor of the file ``spec.key`` names, read-write; InvalidInput if it is no regular file under
    /dev/shm, or is shorter than the region."""
    name = shm_name(spec.key)
    folder = os.open(SHM_FOLDER, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder)
    except OSError as exc:  # missing, a symbolic link (ELOOP), not ours to write (EACCES), a FIFO that blocks...
        raise InvalidInput(f"cannot open shared-memory key {spec.key!r}: {exc.strerror}") from None
    finally:
        os.close(folder)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise InvalidInput(f"shared-memory key {spec.key!r} is not a shared-memory object")
        if found.st_size < spec.offset + spec.byte_size:
            raise InvalidInput(f"shared-memory key {spec.key!r} holds {found.st_size} bytes, fewer than offset "
                               f"{spec.offset} + byte_size {spec.byte_size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


class Region:
    """A registered region this front-end has open."""

    def __init__(self, spec: RegionSpec, fd: int) -> None:
        self.spec, self._fd = spec, fd
        self._users = 0
        self._dropped = False

    def part(self, offset: int, byte_size: int, finite_float32: bool = False) -> RegionBytes:
        """``byte_size`` bytes from ``offset`` into the region; InvalidInput past its end."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.spec.byte_size:
            raise InvalidInput(f"{byte_size} bytes at offset {offset} are outside shared-memory region "
                               f"{self.spec.name!r} of {self.spec.byte_size} bytes")
        return RegionBytes(self, offset, byte_size, finite_float32)

    def read_into(self, offset: int, target: memoryview) -> None:
        wanted = target.nbytes
        got = os.preadv(self._fd, [target], self.spec.offset + offset) if wanted else 0
        if got != wanted:
            raise InvalidInput(f"shared-memory region {self.spec.name!r} ends before the {wanted} bytes at offset "
                               f"{offset} (its file was cut short after it was registered)")

    def write(self, offset: int, data: bytes) -> None:
        """``data`` at ``offset``, never past the end of the file as it is now (that would grow the client's file)."""
        if os.fstat(self._fd).st_size < self.spec.offset + offset + len(data):
            raise InvalidInput(f"shared-memory region {self.spec.name!r} ends before the {len(data)} bytes at offset "
                               f"{offset} (its file was cut short after it was registered)")
        view, position = memoryview(data), self.spec.offset + offset
        while view:
            written = os.pwrite(self._fd, view, position)
            view, position = view[written:], position + written

    @contextlib.contextmanager
    def in_use(self) -> Iterator[Region]:
        """The region held open while a request uses it, even if it is unregistered meanwhile."""
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._dropped and not self._users:
                self._close()

    def drop(self) -> None:
        """Unregistered: closed now, or when the last request using it is done."""
        self._dropped = True
        if not self._users:
            self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RegionBytes:
    """A tensor's bytes in a client's region, read where they go: into a slab slot, or a batch being stacked
    (``resnet_server.common.preprocess.BytesElsewhere``). A float32 tensor's values are checked as they land."""

    def __init__(self, region: Region, offset: int, length: int, finite_float32: bool) -> None:
        self._region, self._offset, self._length = region, offset, length
        self._finite_float32 = finite_float32

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, part: slice) -> RegionBytes:
        start, stop, step = part.indices(self._length)
        if step != 1:
            raise ValueError("a region's bytes are sliced in one piece")
        return RegionBytes(self._region, self._offset + start, max(stop - start, 0), self._finite_float32)

    def read_into(self, target: memoryview) -> None:
        if target.nbytes != self._length:
            raise ValueError(f"{self._length} bytes do not fit a target of {target.nbytes}")
        self._region.read_into(self._offset, target)
        if self._finite_float32 and not np.isfinite(np.frombuffer(target, np.float32)).all():
            raise InvalidInput("raw float32 image contains NaN or infinity")

    def read(self) -> bytearray:
        data = bytearray(self._length)
        self.read_into(memoryview(data))
        return data


class OpenRegions:
    """This front-end's regions, as the supervisor's table says, by owner and name."""

    def __init__(self) -> None:
        self._regions: dict[tuple[str, str], Region] = {}

    def open(self, spec: RegionSpec) -> None:
        """Open a region the table now holds; one this front-end cannot open is logged and left out (a request
        naming it here is refused as if it were not registered)."""
        try:
            fd = open_region(spec)
        except InvalidInput as exc:
            log.warning("shared-memory region %r left out on this front-end: %s", spec.name[:64], exc)
            return
        found = os.fstat(fd)
        if spec.inode and not spec.same_file(found.st_dev, found.st_ino):
            os.close(fd)
            log.warning("shared-memory region %r left out on this front-end: its key %r names another file than "
                        "the one registered", spec.name[:64], spec.key[:64])
            return
        if (old := self._regions.pop((spec.owner, spec.name), None)) is not None:
            old.drop()
        self._regions[spec.owner, spec.name] = Region(spec, fd)

    def close(self, specs: list[RegionSpec]) -> None:
        for spec in specs:
            if (region := self._regions.pop((spec.owner, spec.name), None)) is not None:
                region.drop()

    def find(self, owner: str, name: str) -> Region:
        if (region := self._regions.get((owner, name))) is None:
            raise InvalidInput(f"no shared-memory region {name[:64]!r} is registered")
        return region

    def of(self, owner: str) -> list[RegionSpec]:
        return [region.spec for (held_by, _), region in self._regions.items() if held_by == owner]

    def close_all(self) -> None:
        self.close([region.spec for region in self._regions.values()])
