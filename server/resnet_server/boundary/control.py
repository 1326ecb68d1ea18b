"""Every message between the supervisor and its children, in one place: the control plane.

Each child has two pipes with the supervisor: its reports up, the supervisor's orders down. The messages are
typed (msgspec Structs, MessagePack arrays tagged by :class:`Control`), framed as the data plane frames its own
(``resnet_server.boundary.protocol``), and bounded: none is sent over MOST_MESSAGE_BYTES, and a reader refuses one
that says it is larger. Neither side ever blocks on a write: what a pipe cannot take now waits in the writer's
:class:`Outbox` and goes when the pipe has room, and a peer whose outbox passes MOST_OUTBOX_BYTES has stopped
reading and is cut off, not waited for (two sides each writing more than a pipe holds, each waiting for the other
to read, was a deadlock).

    front-end -> supervisor: Bound, MetricsPort, Serving, Stopped; and requests, each with a call id the front-end
        never reuses: Load, Unload, SetTrace, Register, Unregister
    supervisor -> front-end: Answer (to a call id), WeightsServed, Trace, RegionOpened, RegionsClosed
    engine -> supervisor: MetricsPort, Ready, Stopped; Prepared, Committed, ReloadFailed (to a reload id)
    supervisor -> engine: Prepare, Commit, Abort, each naming a reload id the supervisor never reuses

An error crosses as a status code's name and a short message (MOST_ERROR_CHARACTERS), never a class name or a
traceback.
"""

from __future__ import annotations

import enum
import errno
import os
import select
import struct
import time
from typing import Generic, TypeVar

import msgspec

from resnet_server.boundary.protocol import EngineInfo, MessageReader
from resnet_server.common.served import ServedWeights
from resnet_server.common.shared_regions import RegionSpec

MOST_MESSAGE_BYTES = 64 << 10  # a pipe's capacity: every message is small; one this large is a bug or a peer gone wrong
MOST_OUTBOX_BYTES = 4 << 20  # what may wait for a peer that reads slowly; past it, the peer has stopped reading
MOST_ERROR_CHARACTERS = 512
_LENGTH = struct.Struct("!i")
Message = TypeVar("Message")


class Control(enum.IntEnum):
    """The tag of each control message."""

    BOUND = 1
    METRICS = 2
    SERVING = 3
    READY = 4
    STOPPED = 5
    LOAD = 6
    UNLOAD = 7
    SET_TRACE = 8
    REGISTER = 9
    UNREGISTER = 10
    ANSWER = 11
    WEIGHTS = 12
    TRACE = 13
    REGION_OPENED = 14
    REGIONS_CLOSED = 15
    PREPARE = 16
    COMMIT = 17
    ABORT = 18
    PREPARED = 19
    COMMITTED = 20
    RELOAD_FAILED = 21


class _Message(msgspec.Struct, array_like=True, frozen=True):
    """What every control message is."""


class Bound(_Message, frozen=True, tag=int(Control.BOUND)):
    port: int
    http_port: int = 0  # 0: no HTTP


class MetricsPort(_Message, frozen=True, tag=int(Control.METRICS)):
    port: int


class Serving(_Message, frozen=True, tag=int(Control.SERVING)):
    pass


class Ready(_Message, frozen=True, tag=int(Control.READY)):
    info: EngineInfo


class Stopped(_Message, frozen=True, tag=int(Control.STOPPED)):
    code: int


class Load(_Message, frozen=True, tag=int(Control.LOAD)):
    call: int
    source: str | None  # None: --weights


class Unload(_Message, frozen=True, tag=int(Control.UNLOAD)):
    call: int


class SetTrace(_Message, frozen=True, tag=int(Control.SET_TRACE)):
    call: int
    settings: dict[str, list[str]]


class Register(_Message, frozen=True, tag=int(Control.REGISTER)):
    call: int
    region: RegionSpec


class Unregister(_Message, frozen=True, tag=int(Control.UNREGISTER)):
    call: int
    owner: str
    name: str  # "": every region of the owner


class Answer(_Message, frozen=True, tag=int(Control.ANSWER)):
    call: int
    code: str  # a gRPC status code's name
    message: str


class WeightsServed(_Message, frozen=True, tag=int(Control.WEIGHTS)):
    weights: ServedWeights


class Trace(_Message, frozen=True, tag=int(Control.TRACE)):
    settings: dict[str, list[str]]


class RegionOpened(_Message, frozen=True, tag=int(Control.REGION_OPENED)):
    region: RegionSpec


class RegionsClosed(_Message, frozen=True, tag=int(Control.REGIONS_CLOSED)):
    regions: list[RegionSpec]


class Prepare(_Message, frozen=True, tag=int(Control.PREPARE)):
    reload: int
    source: str


class Commit(_Message, frozen=True, tag=int(Control.COMMIT)):
    reload: int
    version: int


class Abort(_Message, frozen=True, tag=int(Control.ABORT)):
    reload: int


class Prepared(_Message, frozen=True, tag=int(Control.PREPARED)):
    reload: int
    sha256: str


class Committed(_Message, frozen=True, tag=int(Control.COMMITTED)):
    reload: int


class ReloadFailed(_Message, frozen=True, tag=int(Control.RELOAD_FAILED)):
    reload: int
    step: str  # "prepare" or "commit"
    code: str  # a gRPC status code's name: INVALID_ARGUMENT for weights that do not fit, else INTERNAL
    message: str


FrontendReport = Bound | MetricsPort | Serving | Stopped | Load | Unload | SetTrace | Register | Unregister
EngineReport = MetricsPort | Ready | Stopped | Prepared | Committed | ReloadFailed
Report = FrontendReport | EngineReport
FrontendOrder = Answer | WeightsServed | Trace | RegionOpened | RegionsClosed
EngineOrder = Prepare | Commit | Abort

_encoder = msgspec.msgpack.Encoder()
_reports: msgspec.msgpack.Decoder[Report] = msgspec.msgpack.Decoder(Report)
_frontend_orders: msgspec.msgpack.Decoder[FrontendOrder] = msgspec.msgpack.Decoder(FrontendOrder)
_engine_orders: msgspec.msgpack.Decoder[EngineOrder] = msgspec.msgpack.Decoder(EngineOrder)


class TooLarge(ValueError):
    """A control message over MOST_MESSAGE_BYTES: its sender bounds what it sends."""


class PeerStopped(Exception):
    """The peer has ended, or stopped reading: it is cut off."""


def short(message: str) -> str:
    """An error's message as it crosses: its first line, cut to MOST_ERROR_CHARACTERS."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first[:MOST_ERROR_CHARACTERS]


class Outbox:
    """Messages to one peer over a pipe's writing end, written without blocking: what the pipe cannot take now is
    kept (up to MOST_OUTBOX_BYTES) for ``flush``, which the owner calls when the pipe is writable."""

    def __init__(self, fd: int, most_bytes: int = MOST_OUTBOX_BYTES) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._most = most_bytes
        self._pending = bytearray()
        self.closed = False

    @property
    def waiting(self) -> bool:
        """Whether bytes wait for the pipe to take them."""
        return bool(self._pending) and not self.closed

    def send(self, message: msgspec.Struct) -> None:
        """Queue ``message`` and write what the pipe takes now. TooLarge for a message over the bound;
        PeerStopped once the peer has ended or let MOST_OUTBOX_BYTES wait."""
        if self.closed:
            raise PeerStopped("the peer was cut off")
        body = _encoder.encode(message)
        if len(body) > MOST_MESSAGE_BYTES:
            raise TooLarge(f"a {type(message).__name__} of {len(body)} bytes, over {MOST_MESSAGE_BYTES}")
        self._pending += _LENGTH.pack(len(body)) + body
        self.flush()
        if len(self._pending) > self._most:
            self.closed = True
            raise PeerStopped(f"{len(self._pending)} bytes wait for a peer that does not read")

    def flush(self) -> bool:
        """Write what the pipe takes now; True once nothing waits. PeerStopped if the peer has ended."""
        while self._pending and not self.closed:
            try:
                written = os.write(self.fd, self._pending)
            except BlockingIOError:
                return False
            except OSError as exc:  # EPIPE: the peer has ended
                self.closed = True
                raise PeerStopped(os.strerror(exc.errno or errno.EPIPE)) from None
            del self._pending[:written]
        return not self._pending

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for everything to be written (a process about to exit); True if it was."""
        deadline = time.monotonic() + timeout
        try:
            while not self.flush():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                select.select([], [self.fd], [], left)
        except PeerStopped:
            return False
        return True


class Inbox(Generic[Message]):
    """The messages one pipe's reading end holds, read without blocking, each at most MOST_MESSAGE_BYTES."""

    def __init__(self, fd: int, decoder: msgspec.msgpack.Decoder[Message]) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._reader = MessageReader(fd, decoder, MOST_MESSAGE_BYTES)

    def read(self) -> list[Message]:
        """The whole messages that have come (none if none has). EOFError once the peer has ended; PeerStopped for
        a message that cannot be one of ours (too large, or not a control message)."""
        try:
            return self._reader.read()
        except BlockingIOError:
            return []
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise PeerStopped(f"an unreadable control message: {short(str(exc))}") from None


def report_inbox(fd: int) -> Inbox[Report]:
    """The supervisor's reading end of a child's reports."""
    return Inbox(fd, _reports)


def frontend_order_inbox(fd: int) -> Inbox[FrontendOrder]:
    return Inbox(fd, _frontend_orders)


def engine_order_inbox(fd: int) -> Inbox[EngineOrder]:
    return Inbox(fd, _engine_orders)
