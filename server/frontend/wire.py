"""Protobuf's wire format, walked by hand only as far as it takes to leave large bytes fields where they lie.

gRPC hands a servicer each request as one bytes object. Protobuf's parse copies every bytes field out of it,
and reading a field from the parsed message copies it again: an image's pixels were copied twice before the
one copy that matters, into the engine's slab. ``pull_out`` takes one length-delimited field's values out of a
message as memoryviews of the request's own bytes and has protobuf parse everything else, so every other field
means what protobuf says it means. Anything unexpected (a group, a truncated length, a field number 0, a field
protobuf refuses) raises WireError, and the caller then hands the whole request to protobuf, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError, Message

LENGTH_DELIMITED = 2


class WireError(Exception):
    """Wire bytes left to protobuf's own parse."""


def pull_out(message_type: type[Message], view: memoryview, start: int, end: int,
             number: int) -> tuple[Message, list[memoryview]]:
    """The message between ``start`` and ``end`` of ``view``, parsed without its length-delimited field
    ``number``, and that field's values (each occurrence, in order) as views of ``view``."""
    values, others = [], bytearray()
    for field, wire_type, key_at, value_start, value_end in fields(view, start, end):
        if field == number and wire_type == LENGTH_DELIMITED:
            values.append(view[value_start:value_end])
        else:
            others += view[key_at:value_end]
    try:
        return message_type.FromString(bytes(others)), values
    except DecodeError as exc:
        raise WireError(str(exc)) from None


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
