"""Everything that crosses between a front-end process and an engine process, in one place.

A front-end reaches an engine through its :class:`EngineLink`: a Unix socket for small messages and the
engine's shared slab (``resnet_server.boundary.slab``) for the pixels and the scores, which never go through the
socket. The messages are typed (msgspec Structs, encoded as MessagePack arrays whose first element is the message's
:class:`Kind`), so each side decodes into the types below and dispatches on the type through a table.

    front-end -> engine: Hello (once), Submit, Cancel
    engine -> front-end: Ready (once, after Hello), Done, Failed, Released, Health

msgspec rather than pickle: its validated decode costs no more than pickle's round trip for these messages
(the measure is in docs/performance.md, "The engine protocol").

At ``--log-level DEBUG`` the logger ``server.protocol`` notes every message as it is sent (each side logs
what it sends), the message itself in the record's ``engine_message``.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from resnet_server.boundary.slab import SlabLayout
from resnet_server.common.statistics import BatchTiming


class Kind(enum.IntEnum):
    """The tag of each message on the socket."""

    HELLO = 1
    READY = 2
    SUBMIT = 3
    CANCEL = 4
    DONE = 5
    FAILED = 6
    RELEASED = 7
    HEALTH = 8


class ImageKind(enum.IntEnum):
    """How an image's bytes in its slot are to be read by the engine."""

    RAW = 0  # a checked raw tensor: dtype and shape say how
    JPEG = 1  # JPEG bytes, decoded by the engine (on its device where it decodes there)
    CROP = 2  # a front-end's uint8 [224, 224, 3] centre crop, normalised by the engine with its batch
    FLOAT = 3  # the model's float32 input [3, 224, 224], preprocessed by the front-end


class SlotEntry(msgspec.Struct, array_like=True, frozen=True):
    """One image a front-end has written into ``slot``, and how it is to be answered."""

    slot: int
    kind: ImageKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    temperature: float
    top_k: int
    deadline: float | None  # time.monotonic() after which the caller no longer waits (machine-wide clock)
    call: int  # its call's request id: Submit.request_ids[call] (an id once a call, not once an image)


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine tells the supervisor and each front-end once its model is warm."""

    name: str  # the replica's name, e.g. cuda:0
    device: str
    weights: str
    warning: str
    max_batch_size: int
    decode_on_device: bool
    in_rotation: bool
    switch_interval_ms: float
    torch_threads: int
    runs: str  # how its batches run: 'cuda:0 runs fp16 as CUDA graphs at batch sizes 1, 2, ...'
    takes_crops: bool  # images a front-end preprocesses come as uint8 crops (else as the float input)
    weights_version: int = 1  # of the weights served now: 1 at start, one more with each reload
    weights_sha256: str = ""


class Answer(msgspec.Struct, array_like=True, frozen=True):
    """One image answered: its scores are in its slot's output rows."""

    slot: int
    top_k: list[tuple[int, float]]
    queue_seconds: float


class Hello(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.HELLO)):
    owner: int  # the front-end's number in the slab's owner column


class Ready(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.READY)):
    info: EngineInfo


class Submit(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.SUBMIT)):
    entries: list[SlotEntry]
    request_ids: list[str]  # one a call, for the engine's log lines about its batch
    clients: list[str]  # one a call: whose share of the device it takes (resnet_server.engine.fair_queue)
    priorities: list[int]  # one a call: its rank among its client's calls (0: none asked)
    weights: list[int]  # one a call: its client's share beside the others'


class Cancel(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.CANCEL)):
    slots: list[int]  # callers gone: drop what has not been computed (answered by Released)


class Done(msgspec.Struct, array_like=True, frozen=True, kw_only=True, tag=int(Kind.DONE)):
    answers: list[Answer]
    timing: BatchTiming  # the batch's input, infer and output seconds
    in_rotation: bool
    weights_version: int  # of the weights that computed the batch
    batch: int = 0  # the batch's number on its engine, counted from 1 (tracing links the calls it served)
    batch_size: int = 0  # its images, from every front-end
    buckets: list[int] = []  # the sizes it ran at: its bucket (padded, on CUDA) or the buckets it was split into


class Failed(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.FAILED)):
    slots: list[int]
    error: str  # the name of a resnet_server.common.errors.ServingError subclass
    message: str
    in_rotation: bool


class Released(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.RELEASED)):
    slots: list[int]  # dropped before compute: the slots are the front-end's again


class Health(msgspec.Struct, array_like=True, frozen=True, tag=int(Kind.HEALTH)):
    in_rotation: bool


ToEngine = Hello | Submit | Cancel
ToFrontEnd = Ready | Done | Failed | Released | Health

trace = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_to_engine: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(ToEngine)
_to_frontend: msgspec.msgpack.Decoder[ToFrontEnd] = msgspec.msgpack.Decoder(ToFrontEnd)
Message = TypeVar("Message")  # what one side reads: ToEngine or ToFrontEnd


def send(connection: Connection, message: ToEngine | ToFrontEnd) -> None:
    connection.send_bytes(encode(message))


def encode(message: ToEngine | ToFrontEnd) -> bytes:
    """The message's body, as ``send`` writes it (after its length); noted in the DEBUG log as it leaves."""
    if trace.isEnabledFor(logging.DEBUG):  # a cached check: free when off
        trace.debug("sent %r", message, extra={"engine_message": message})
    return _encoder.encode(message)


def frame(message: ToEngine | ToFrontEnd) -> bytes:
    """The message as it goes on the socket: its length (multiprocessing's framing), then its body."""
    body = encode(message)
    return _LENGTH.pack(len(body)) + body  # messages here are far under 2 GiB


def receive_at_engine(connection: Connection) -> ToEngine:
    return _to_engine.decode(connection.recv_bytes())


def receive_at_frontend(connection: Connection) -> ToFrontEnd:
    return _to_frontend.decode(connection.recv_bytes())


_LENGTH = struct.Struct("!i")  # multiprocessing's framing, which Connection.send_bytes writes: a length,
_LONG_LENGTH = struct.Struct("!Q")  # or -1 and then this one for a message of 2 GiB or more
FIRST_READ_BYTES = 1 << 16  # under malloc's mmap threshold: the buffer is made once, never mapped per read


class MessageReader(Generic[Message]):
    """The messages one socket holds, read with one system call however many have arrived (``recv_bytes``
    makes two a message: its length, then its body). Under load an engine's answers and a front-end's
    submits come several to a wake-up; each system call costs as much as decoding a message."""

    def __init__(self, source: Connection | int, decoder: msgspec.msgpack.Decoder[Message],
                 most_message_bytes: int | None = None) -> None:
        self._fd = source if isinstance(source, int) else source.fileno()
        self._decode = decoder.decode
        self._most = most_message_bytes  # a larger message is refused (ValueError), not buffered
        self._buffer = memoryview(bytearray(FIRST_READ_BYTES))
        self._kept = 0  # bytes of a message not yet whole, at the buffer's start

    def read(self) -> list[Message]:
        """The whole messages read (none if only part of one came); blocks on a blocking socket until some
        bytes come. EOFError once the socket has closed."""
        if self._kept == len(self._buffer):  # one message larger than the buffer: make room for more of it
            self._buffer = memoryview(bytearray(self._buffer) + bytearray(len(self._buffer)))
        count = os.readv(self._fd, [self._buffer[self._kept:]])
        if count == 0:
            raise EOFError("the socket closed")
        end, position = self._kept + count, 0
        messages: list[Message] = []
        while (body := self._body_at(position, end)) is not None:
            start, position = body
            messages.append(self._decode(self._buffer[start:position]))
        self._kept = end - position
        if self._kept and position:  # part of a message follows whole ones: move it to the buffer's start
            self._buffer[:self._kept] = bytes(self._buffer[position:end])
        return messages

    def _body_at(self, position: int, end: int) -> tuple[int, int] | None:
        """Where the message at ``position`` starts and ends, if all of it is before ``end``."""
        if end - position < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack_from(self._buffer, position)
        start = position + _LENGTH.size
        if size == -1:
            if end - start < _LONG_LENGTH.size:
                return None
            (size,) = _LONG_LENGTH.unpack_from(self._buffer, start)
            start += _LONG_LENGTH.size
        if self._most is not None and not 0 <= size <= self._most:
            raise ValueError(f"a message of {size} bytes, over the {self._most} a message may hold")
        return (start, start + size) if start + size <= end else None


def engine_messages(connection: Connection) -> MessageReader[ToEngine]:
    """What a front-end sends, as the engine reads it (after Hello, which ``receive_at_engine`` takes)."""
    return MessageReader(connection, _to_engine)


def frontend_messages(connection: Connection) -> MessageReader[ToFrontEnd]:
    """What an engine sends, as a front-end reads it (after Ready, which ``receive_at_frontend`` takes)."""
    return MessageReader(connection, _to_frontend)


@dataclass(frozen=True)
class EngineLink:
    """How a front-end reaches one engine: its socket, key and slab. Pickled for a spawned child, the slab's
    descriptor travels with it (the child gets its own copy of the file descriptor)."""

    name: str  # the replica's name, e.g. cuda:0
    address: str
    authkey: bytes
    layout: SlabLayout
    slab_fd: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild_link, (self.name, self.address, self.authkey, self.layout, reduction.DupFd(self.slab_fd))


class _Duplicated(Protocol):
    """What ``reduction.DupFd`` makes of a descriptor, once unpickled in the child."""

    def detach(self) -> int: ...


def _rebuild_link(name: str, address: str, authkey: bytes, layout: SlabLayout, fd: _Duplicated) -> EngineLink:
    return EngineLink(name, address, authkey, layout, fd.detach())
