"""The system shared-memory regions clients have registered (Triton's system shared-memory extension): what a
key may name, and the table of regions with its limits and owners.

A key names a file directly under ``/dev/shm`` (a POSIX shared-memory name: one leading slash at most, no other
slash, no ``..``, no NUL). Nothing of the server's own can be named: its slabs are memfds with no name, and the
prefixes below are refused whatever exists under them now or later.

Regions belong to their owner: the digest of the bearer token that registered them (with ``--auth-token-file``;
without tokens every client is the one owner ""). An owner's names are its own: another token sees none of
them, cannot use or unregister them, and may register the same name for a region of its own. The supervisor
holds the table every front-end follows (``resnet_server.supervisor.launcher``); each front-end opens the regions it
is told of (``resnet_server.frontend.shared_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

from resnet_server.common.errors import AlreadyExists, InvalidInput, NotFound, Overloaded, PermissionDenied

SHM_FOLDER = "/dev/shm"
# "sem.": POSIX named semaphores (multiprocessing's among them) live in /dev/shm under this prefix; "resnet":
# kept for the server's own, should it ever name one.
RESERVED_PREFIXES = ("sem.", "resnet")
MOST_KEY_CHARACTERS = 255  # NAME_MAX


def shm_name(key: str) -> str:
    """The file under /dev/shm that ``key`` names; InvalidInput says why a key names none that a client may use."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or "\0" in name or name in (".", "..") or len(name) > MOST_KEY_CHARACTERS:
        raise InvalidInput(f"shared-memory key {key[:80]!r} is not a POSIX shared-memory name: one leading '/' at "
                           f"most, then 1 to {MOST_KEY_CHARACTERS} characters with no '/' or NUL, not '.' or '..'")
    if name.lower().startswith(RESERVED_PREFIXES):
        raise InvalidInput(f"shared-memory key {key[:80]!r} is reserved: keys starting {' or '.join(RESERVED_PREFIXES)}"
                           " name no client's region")
    return name


@dataclass(frozen=True)
class RegionSpec:
    """A registered region: ``byte_size`` bytes from ``offset`` of the file ``key`` names, under its owner's
    ``name``."""

    owner: str
    name: str
    key: str
    offset: int
    byte_size: int
    # The file's identity when it was registered (st_dev, st_ino): every front-end opens that file, or none.
    device: int = 0
    inode: int = 0

    def same_file(self, device: int, inode: int) -> bool:
        return (self.device, self.inode) == (device, inode)


@dataclass(frozen=True)
class RegionLimits:
    regions: int  # per owner
    total_bytes: int  # per owner, every region's byte_size together


class RegionTable:
    """Every registered region, by owner and name."""

    def __init__(self, limits: RegionLimits) -> None:
        self.limits = limits
        self._regions: dict[tuple[str, str], RegionSpec] = {}

    def specs(self) -> list[RegionSpec]:
        return list(self._regions.values())

    def add(self, spec: RegionSpec) -> None:
        """Register ``spec``; AlreadyExists for a name its owner has registered, Overloaded over a limit."""
        if not spec.name:
            raise InvalidInput("a shared-memory region needs a name")
        if (spec.owner, spec.name) in self._regions:
            raise AlreadyExists(f"shared-memory region {spec.name[:64]!r} is registered already; unregister it first")
        for region in self._regions.values():
            if region.key == spec.key and region.owner != spec.owner:
                raise PermissionDenied(f"shared-memory key {spec.key[:64]!r} is registered by another client")
            if region.key == spec.key and not region.same_file(spec.device, spec.inode):
                raise AlreadyExists(f"shared-memory key {spec.key[:64]!r} names another file than the one registered "
                                    "under it; unregister its regions first")
        held = [region for region in self._regions.values() if region.owner == spec.owner]
        if len(held) >= self.limits.regions:
            raise Overloaded(f"{len(held)} shared-memory regions are registered by this client, its limit "
                             "(--max-shm-regions); unregister one first")
        total = sum(region.byte_size for region in held) + spec.byte_size
        if total > self.limits.total_bytes:
            raise Overloaded(f"this client's shared-memory regions would hold {total} bytes, over its limit of "
                             f"{self.limits.total_bytes} (--max-shm-mb)")
        self._regions[spec.owner, spec.name] = spec

    def remove(self, owner: str, name: str) -> list[RegionSpec]:
        """Unregister ``owner``'s region ``name``, or every one of its regions for the name ""; NotFound for a name
        it has not registered."""
        if not name:
            gone = [spec for spec in self._regions.values() if spec.owner == owner]
        elif (spec := self._regions.get((owner, name))) is not None:
            gone = [spec]
        else:
            raise NotFound(f"no shared-memory region {name[:64]!r} is registered")
        for spec in gone:
            del self._regions[spec.owner, spec.name]
        return gone
