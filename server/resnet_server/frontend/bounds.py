"""Every count and length a client controls, bounded in a request's wire bytes before anything parses it.

gRPC hands each request to its deserializer as one bytes object, and protobuf's parse, in C, then makes every value
it holds: a packed ``shape`` of 20 million entries, a map of millions of keys, a model name of 60 MiB. Each is
valid protobuf, bounded only by the message limit, and each then costs the event loop seconds to list, format or
pickle, and the process gigabytes. So before a request is parsed, its wire bytes are walked here with its
message's descriptor, and it is refused (INVALID_ARGUMENT, naming the field and the bound, never echoing the
value) where:

- a repeated field or map holds more than ``most_entries`` entries (a packed field's entries counted from its
  bytes, without reading them);
- a string holds more than ``most_string_bytes`` bytes (names, ids, settings: whatever is echoed, logged, traced
  or sent to the supervisor);
- messages nest deeper than ``most_depth``, or the walk meets more than ``most_fields`` fields in all.

``bytes`` fields (images, pixels, files) are bounded by the message limit alone. A field whose bound differs is
named in ``WireBounds.entries`` or ``WireBounds.lengths`` by its full name. The walk is applied to every method
at registration (``resnet_server.frontend.server.add_servicer``), so an RPC or a field added later is bounded without
anyone remembering to.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from resnet_server.frontend.wire import FALLBACK_BYTES, LENGTH_DELIMITED, WireError, fields

MOST_ENTRIES = 64
MOST_STRING_BYTES = 256
MOST_DEPTH = 8
MOST_FIELDS = 4096
_FIXED32 = {FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT}
_FIXED64 = {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE}
_NEVER_PACKED = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE,
                 FieldDescriptor.TYPE_GROUP}
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))  # every byte of a varint but its last


class OverBound(Exception):
    """Why a request is refused unread: the field and its bound, never the value."""


@dataclass(frozen=True, eq=False)
class WireBounds:
    """The bounds one server applies; ``entries`` and ``lengths`` give a field's own, by its full name."""

    most_entries: int = MOST_ENTRIES
    most_string_bytes: int = MOST_STRING_BYTES
    most_depth: int = MOST_DEPTH
    most_fields: int = MOST_FIELDS
    entries: Mapping[str, int] = field(default_factory=dict)
    lengths: Mapping[str, int] = field(default_factory=dict)
    flags: Mapping[str, str] = field(default_factory=dict)  # the flag that sets a field's bound, to name it


class _Plan(NamedTuple):
    """How one field of a message is bounded."""

    name: str  # its full name, and the flag that sets its bound if one does
    repeated: bool
    most_entries: int
    most_length: int | None  # a string's bytes; None for bytes and for messages
    message: Descriptor | None
    entry_bytes: int | None  # a packed number's bytes an entry (0: varints, counted by their last bytes); None
    # for strings, bytes and messages, which are never packed


def check(descriptor: Descriptor, data: bytes | memoryview, bounds: WireBounds) -> None:
    """Raise OverBound if the request ``data`` (a ``descriptor`` message) holds more than ``bounds`` allow. Bytes
    the walk cannot read (``resnet_server.frontend.wire``) are left to protobuf's parse up to FALLBACK_BYTES."""
    view = memoryview(data)
    try:
        _walk(descriptor, view, 0, len(view), 0, [bounds.most_fields], bounds)
    except WireError as exc:
        if len(view) > FALLBACK_BYTES:
            raise OverBound(f"the request is not a {descriptor.full_name} this server reads ({exc}, "
                            f"in {len(view)} bytes)") from None


def _walk(descriptor: Descriptor, view: memoryview, start: int, end: int, depth: int, budget: list[int],
          bounds: WireBounds) -> None:
    plans = _plans(descriptor, bounds)
    counts: dict[int, int] = {}
    for number, wire_type, _, value_start, value_end in fields(view, start, end):
        budget[0] -= 1
        if budget[0] < 0:
            raise OverBound(f"the request holds more than {bounds.most_fields} fields")
        plan = plans.get(number)
        if plan is None:  # an unknown field: counted in the budget, never parsed into anything
            continue
        if plan.repeated:
            counts[number] = seen = counts.get(number, 0) + _entries(plan, view, wire_type, value_start, value_end)
            if seen > plan.most_entries:
                raise OverBound(f"{plan.name} holds more than {plan.most_entries} entries")
        if wire_type != LENGTH_DELIMITED:
            continue
        if plan.most_length is not None and value_end - value_start > plan.most_length:
            raise OverBound(f"{plan.name} is longer than {plan.most_length} bytes")
        if plan.message is not None:
            if depth + 1 >= bounds.most_depth:
                raise OverBound(f"{plan.name} nests messages deeper than {bounds.most_depth}")
            _walk(plan.message, view, value_start, value_end, depth + 1, budget, bounds)


def _entries(plan: _Plan, view: memoryview, wire_type: int, start: int, end: int) -> int:
    """How many entries one occurrence of a repeated field adds: one, or a packed run's count."""
    if wire_type != LENGTH_DELIMITED or plan.entry_bytes is None:
        return 1
    length = end - start
    if plan.entry_bytes:
        return length // plan.entry_bytes
    if length <= plan.most_entries:  # a varint is one byte at least: no more entries than bytes
        return length
    return len(bytes(view[start:end]).translate(None, delete=_CONTINUATION_BYTES))


@functools.lru_cache(maxsize=512)
def _plans(descriptor: Descriptor, bounds: WireBounds) -> dict[int, _Plan]:
    """Each field's bounds by its number, worked out once per message type and bounds (compared by identity)."""
    return {number: _plan(field_descriptor, bounds) for number, field_descriptor in descriptor.fields_by_number.items()}


def _plan(field_descriptor: FieldDescriptor, bounds: WireBounds) -> _Plan:
    name = field_descriptor.full_name
    kind = field_descriptor.type
    most_length = None
    if kind == FieldDescriptor.TYPE_STRING:
        most_length = bounds.lengths.get(name, bounds.most_string_bytes)
    elif kind == FieldDescriptor.TYPE_BYTES and name in bounds.lengths:
        most_length = bounds.lengths[name]
    message = field_descriptor.message_type if kind == FieldDescriptor.TYPE_MESSAGE else None
    entry_bytes = 4 if kind in _FIXED32 else 8 if kind in _FIXED64 else None if kind in _NEVER_PACKED else 0
    shown = f"{name} ({bounds.flags[name]})" if name in bounds.flags else name
    return _Plan(shown, bool(field_descriptor.is_repeated), bounds.entries.get(name, bounds.most_entries), most_length,
                 message, entry_bytes)


MOST_DIMENSIONS = 8  # a tensor's shape: the model's inputs have four
UNBOUNDED = 1 << 40  # typed tensor contents: packed numbers, bounded by the message limit as pixels are
MOST_CONFIG_BYTES = 64 << 10  # a ModelConfig's JSON in RepositoryModelLoad (a real one is about 1 KB)


def served_bounds(max_images: int, max_raw_contents: int) -> WireBounds:
    """The bounds of this server's requests: the defaults, and the fields that carry images or take more."""
    typed_contents = {f"inference.InferTensorContents.{kind}_contents": UNBOUNDED
                      for kind in ("bool", "int", "int64", "uint", "uint64", "fp32", "fp64")}
    return WireBounds(
        entries={
            "resnet.v1.ClassifyRequest.images": max_images,
            "inference.InferTensorContents.bytes_contents": max_images,
            "inference.ModelInferRequest.raw_input_contents": max_raw_contents,
            "resnet.v1.RawTensor.shape": MOST_DIMENSIONS,
            "inference.ModelInferRequest.InferInputTensor.shape": MOST_DIMENSIONS,
            **typed_contents,
        },
        lengths={"inference.ModelRepositoryParameter.string_param": MOST_CONFIG_BYTES},
        flags={"resnet.v1.ClassifyRequest.images": "--max-images-per-request",
               "inference.InferTensorContents.bytes_contents": "--max-images-per-request"},
    )
