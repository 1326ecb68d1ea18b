"""Protobuf messages as Triton's REST API writes them: protobuf's JSON mapping with the fields' declared names, but
64-bit integers as JSON numbers where the mapping writes strings."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def as_json(message: Message) -> dict[str, Any]:
    """A message in protobuf's JSON mapping with its field names as declared, but 64-bit integers as numbers (as
    Triton's REST API writes them, where the mapping writes strings)."""
    return _numbers(message, json_format.MessageToDict(message, preserving_proto_field_name=True))


_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}


def _numbers(message: Message, shown: dict[str, Any]) -> dict[str, Any]:
    for field, value in message.ListFields():
        name = field.name
        if name not in shown:
            continue
        if field.cpp_type in _INT64:
            shown[name] = [int(v) for v in shown[name]] if field.is_repeated else int(shown[name])
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                shown[name] = {key: _numbers(value[key], shown[name][key]) for key in shown[name]}
            elif value_field.cpp_type in _INT64:
                shown[name] = {key: int(item) for key, item in shown[name].items()}
        elif field.message_type is not None:
            if field.is_repeated:
                shown[name] = [_numbers(item, entry) for item, entry in zip(value, shown[name], strict=True)]
            else:
                shown[name] = _numbers(value, shown[name])
    return shown
