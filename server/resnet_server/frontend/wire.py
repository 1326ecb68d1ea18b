"""Protobuf's wire format, walked by hand only as far as it takes to leave large bytes fields where they lie.

gRPC hands a servicer each request as one bytes object. Protobuf's parse copies every bytes field out of it,
and reading a field from the parsed message copies it again: an image's pixels were copied twice before the
one copy that matters, into the engine's slab. ``pull_out`` takes one length-delimited field's values out of a
message as memoryviews of the request's own bytes and has protobuf parse everything else, so every other field
means what protobuf says it means. Anything unexpected (a group, a truncated length, a field number 0, a field
protobuf refuses) raises WireError, and the caller then hands the whole request to protobuf's own parse.

The walk runs on the event loop (gRPC calls a request's deserializer there) and costs Python work per field, so it
is bounded: past ``most`` values of the pulled field it stops with TooMany (the request is refused unread), and
past MOST_OTHER_FIELDS other fields it stops with WireError. Protobuf's own parse, in C, is then asked only of a
request up to FALLBACK_BYTES: no client's serializer writes that many fields, and a larger request of that shape
is a flood (millions of empty fields) that would cost protobuf gigabytes too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)
LENGTH_DELIMITED = 2
MOST_OTHER_FIELDS = 64  # a message's fields besides the pulled one: a handful in any real request
FALLBACK_BYTES = 1 << 20  # the largest request handed to protobuf's own parse when the walk gives up


class WireError(Exception):
    """Wire bytes left to protobuf's own parse."""


class Unreadable(Exception):
    """Why a request is refused unread; its message is the caller's INVALID_ARGUMENT."""


class TooMany(Exception):
    """More values of the pulled field than the caller takes: the request is refused without reading on."""

    def __init__(self, most: int) -> None:
        super().__init__(most)
        self.most = most


def pull_out(message_type: type[M], view: memoryview, start: int, end: int,
             number: int, most: int) -> tuple[M, list[memoryview]]:
    """The message between ``start`` and ``end`` of ``view``, parsed without its length-delimited field
    ``number``, and that field's values (each occurrence, in order, at most ``most`` of them, else TooMany) as
    views of ``view``."""
    values: list[memoryview] = []
    others, other_count = bytearray(), 0
    for field, wire_type, key_at, value_start, value_end in fields(view, start, end):
        if field == number and wire_type == LENGTH_DELIMITED:
            if len(values) == most:
                raise TooMany(most)
            values.append(view[value_start:value_end])
        else:
            other_count += 1
            if other_count > MOST_OTHER_FIELDS:
                raise WireError(f"more than {MOST_OTHER_FIELDS} fields besides field {number}")
            others += view[key_at:value_end]
    try:
        return message_type.FromString(bytes(others)), values
    except DecodeError as exc:
        raise WireError(str(exc)) from None


def parse_whole(message_type: type[M], data: bytes, walk_error: WireError) -> M:
    """Protobuf's own parse of a request the walk gave up on (``walk_error`` says why); Unreadable where the
    request is too large for that (see the module's docstring) or protobuf refuses it."""
    name = message_type.DESCRIPTOR.full_name
    not_one = f"the request is not {'an' if name[0] in 'aeiou' else 'a'} {name}"
    if len(data) > FALLBACK_BYTES:
        raise Unreadable(f"{not_one} as this server reads one ({walk_error}, in {len(data)} bytes)")
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        raise Unreadable(f"{not_one}: {exc}") from None


def fields(view: memoryview, position: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field between ``position`` and ``end``: (number, wire type, where its key starts, where its value
    starts and ends; a length-delimited value without its length)."""
    while position < end:
        key_at = position
        key, position = _varint(view, position, end)
        wire_type = key & 7
        if key >> 3 == 0:  # no field has number 0: protobuf refuses the message
            raise WireError("field number 0")
        if wire_type == 0:
            _, value_end = _varint(view, position, end)
        elif wire_type == LENGTH_DELIMITED:
            length, position = _varint(view, position, end)
            value_end = position + length
        elif wire_type == 1:
            value_end = position + 8
        elif wire_type == 5:
            value_end = position + 4
        else:  # groups (3, 4) and wire types that do not exist
            raise WireError(f"wire type {wire_type}")
        if value_end > end:
            raise WireError("a field runs past its message")
        yield key >> 3, wire_type, key_at, position, value_end
        position = value_end


def _varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    if position < end and view[position] < 0x80:  # most keys and small values: one byte
        return view[position], position + 1
    value = shift = 0
    while position < end:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            break
    raise WireError("a truncated or overlong varint")
