"""The Open Inference Protocol's REST body (KServe v2) and Triton's binary tensor extension, read into the same
``ModelInferRequest`` the gRPC servicer takes, and its answer written back: the HTTP front-end
(resnet_server.frontend.http_api) translates, the servicer (resnet_server.frontend.oip_service) serves.

A body is JSON, or, with an ``Inference-Header-Content-Length`` header, that many bytes of JSON followed by the
tensors' raw bytes, each input's ``binary_data_size`` of them in order (tritonclient.http's default). Raw bytes
go on as memoryviews of the body, never through JSON numbers. Every count a client controls is bounded before
Python objects are made of it: the JSON's objects and keys by a count of their bytes, each input's ``data`` kept
as raw JSON text and read into one NumPy array a slice at a time (numbers) or checked for its count first
(strings).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np

from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.common.errors import InvalidInput
from resnet_server.frontend.bounds import MOST_DIMENSIONS, MOST_ENTRIES, MOST_FIELDS, MOST_STRING_BYTES
from resnet_server.frontend.infer_parameters import SHM_BYTE_SIZE
from resnet_server.frontend.oip_codec import parse_bytes_tensor, serialize_bytes_tensor

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_DATA_SIZE, BINARY_DATA, BINARY_DATA_OUTPUT = "binary_data_size", "binary_data", "binary_data_output"
_TRANSPORT_PARAMETERS = {BINARY_DATA_SIZE, BINARY_DATA, BINARY_DATA_OUTPUT}
MOST_OBJECTS = MOST_ENTRIES * 4  # a request's JSON objects: itself, its tensors and their parameters
_BRACKETS_TO_SPACES = bytes.maketrans(b"[]", b"  ")
NUMBERS_SLICE = 1 << 20  # bytes of a JSON tensor's numbers read into Python objects at once
_read_numbers = msgspec.json.Decoder(list[float])
_NUMBER_TYPES = {"FP32": "<f4", "UINT8": "u1"}

Name = Annotated[str, msgspec.Meta(max_length=MOST_STRING_BYTES)]
Scalar = bool | int | float | str
Parameters = dict[Name, Scalar]


class _Input(msgspec.Struct):
    name: Name
    datatype: Name
    shape: msgspec.Raw  # read below with its own bound
    parameters: Parameters = {}
    data: msgspec.Raw = msgspec.Raw()  # empty: none (its bytes are binary, or in a shared-memory region)


class _Output(msgspec.Struct):
    name: Name
    parameters: Parameters = {}


class _InferBody(msgspec.Struct):
    inputs: list[_Input]
    id: Name = ""
    parameters: Parameters = {}
    outputs: list[_Output] = []


_read_body = msgspec.json.Decoder(_InferBody)


class HttpInferRequest(NamedTuple):
    """A REST inference request as the servicer takes it, and which outputs go back as raw bytes."""

    message: oip.ModelInferRequest
    raw_input_contents: list[memoryview]
    binary_outputs: frozenset[str]
    all_binary: bool


def read_infer_body(body: bytes, header_length: str | None, model: str, version: str) -> HttpInferRequest:
    """The request in ``body`` for model ``model`` (its URL's): JSON alone, or JSON of ``header_length`` bytes and
    the inputs' raw bytes after it."""
    view = memoryview(body)
    json_end = _json_length(header_length, len(body))
    text = view[:json_end]
    check_counts(text)
    try:
        parsed = _read_body.decode(text)
    except RecursionError:
        raise InvalidInput("the request's JSON nests too deep") from None
    except msgspec.DecodeError as exc:  # ValidationError included: the field it names is the request's
        raise InvalidInput(f"the request body is not an inference request: {str(exc)[:200]}") from None
    if len(parsed.inputs) > MOST_ENTRIES or len(parsed.outputs) > MOST_ENTRIES:
        raise InvalidInput(f"a request holds at most {MOST_ENTRIES} inputs and {MOST_ENTRIES} outputs")
    message = oip.ModelInferRequest(model_name=model, model_version=version, id=parsed.id)
    _set_parameters(message.parameters, parsed.parameters)
    raw = _inputs(message, parsed.inputs, view[json_end:])
    for output in parsed.outputs:
        _set_parameters(message.outputs.add(name=output.name).parameters, output.parameters)
    binary = frozenset(output.name for output in parsed.outputs if output.parameters.get(BINARY_DATA) is True)
    return HttpInferRequest(message, raw, binary, parsed.parameters.get(BINARY_DATA_OUTPUT) is True)


def _json_length(header_length: str | None, body_length: int) -> int:
    if header_length is None:
        return body_length
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(f"{HEADER_LENGTH} must be a whole number of bytes") from None
    if not 0 <= length <= body_length:
        raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the body holds {body_length} bytes")
    return length


def check_counts(text: bytes | memoryview, values: bool = False) -> None:
    """Objects and keys (and with ``values``, values: for JSON whose bytes travel in base64) counted in the JSON's
    bytes before it is parsed (those inside strings count too, so this errs on the side of refusing): a flood of
    them would cost more memory than its bytes, many times over."""
    data = bytes(text)
    if data.count(b"{") > MOST_OBJECTS or data.count(b":") > MOST_FIELDS or (values and data.count(b",") > MOST_FIELDS):
        raise InvalidInput(f"the request's JSON holds more than {MOST_OBJECTS} objects or {MOST_FIELDS} keys "
                           "or values")


def _set_parameters(into, parameters: Mapping[str, Any]) -> None:
    """A JSON parameters object as protobuf's InferParameter map, without the binary extension's own."""
    if len(parameters) > MOST_ENTRIES:
        raise InvalidInput(f"parameters hold more than {MOST_ENTRIES} entries")
    for key, value in parameters.items():
        if key in _TRANSPORT_PARAMETERS:
            continue
        if isinstance(value, bool):
            into[key].bool_param = value
        elif isinstance(value, int):
            if not -(1 << 63) <= value < 1 << 63:
                raise InvalidInput(f"parameter {key!r} is out of range")
            into[key].int64_param = value
        elif isinstance(value, float):
            into[key].double_param = value
        else:
            into[key].string_param = value


def _inputs(message: oip.ModelInferRequest, inputs: Sequence[_Input], binary: memoryview) -> list[memoryview]:
    """Each input into ``message``, and its bytes, in order: cut from ``binary``, or its JSON ``data`` made into the
    same little-endian bytes (so both forms take one path from here); an input in a shared-memory region has
    none."""
    raw: list[memoryview] = []
    offset = 0
    for tensor in inputs:
        shape = _shape(tensor.shape)
        proto = message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
        _set_parameters(proto.parameters, tensor.parameters)
        size = tensor.parameters.get(BINARY_DATA_SIZE)
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidInput(f"input {tensor.name[:64]!r}: {BINARY_DATA_SIZE} must be a count of bytes "
                                   f"within the {len(binary)} after the JSON")
            raw.append(binary[offset:offset + size])
            offset += size
        elif len(tensor.data):
            raw.append(memoryview(_json_bytes(tensor.name, tensor.datatype, tensor.data, shape)))
        elif SHM_BYTE_SIZE not in tensor.parameters:
            raise InvalidInput(f"input {tensor.name[:64]!r} has no data, {BINARY_DATA_SIZE} or shared-memory region")
    if offset != len(binary):
        raise InvalidInput(f"the body holds {len(binary) - offset} bytes after the inputs' binary data")
    return raw


def _shape(raw: msgspec.Raw) -> list[int]:
    if len(raw) > MOST_STRING_BYTES:
        raise InvalidInput(f"a shape is longer than {MOST_STRING_BYTES} bytes of JSON")
    try:
        shape = msgspec.json.decode(raw, type=list[int])
    except msgspec.DecodeError:
        raise InvalidInput("a shape must be a list of whole numbers") from None
    if len(shape) > MOST_DIMENSIONS or any(not 0 <= size < 1 << 40 for size in shape):
        raise InvalidInput(f"a shape has at most {MOST_DIMENSIONS} dimensions, each a size from 0")
    return shape


def _json_bytes(name: str, datatype: str, data: msgspec.Raw, shape: list[int]) -> bytes:
    """JSON ``data``, flat or nested (row-major), as the tensor's raw bytes: numbers read as one array, strings
    counted before they are listed."""
    count = math.prod(shape)
    text = bytes(data)
    if datatype == "BYTES":
        if (text.count(b'"') - text.count(b'\\"')) // 2 > count:
            raise InvalidInput(f"input {name[:64]!r} holds more strings than its shape {shape}")
        try:
            strings = msgspec.json.decode(text, type=list[str])
        except msgspec.DecodeError:
            raise InvalidInput(f"input {name[:64]!r}: BYTES data must be a list of strings") from None
        return serialize_bytes_tensor([string.encode() for string in strings])
    if datatype not in _NUMBER_TYPES:
        raise InvalidInput(f"input datatype must be FP32, UINT8 or BYTES, got {datatype[:16]!r}")
    # Values, nested or not, are one more than the commas between them: counted before any is read.
    if count and text.count(b",") + 1 != count:
        raise InvalidInput(f"input {name[:64]!r} of shape {shape} needs {count} values, got "
                           f"{text.count(b',') + 1}")
    values = _numbers(text, name)
    if values.size != count:
        raise InvalidInput(f"input {name[:64]!r} of shape {shape} needs {count} values, got {values.size}")
    if datatype == "UINT8" and values.size and (values.min() < 0 or values.max() > 255
                                                or not np.array_equal(values, np.floor(values))):
        raise InvalidInput(f"input {name[:64]!r}: UINT8 data must be whole numbers from 0 to 255")
    return values.astype(_NUMBER_TYPES[datatype]).tobytes()


def _numbers(text: bytes, name: str) -> np.ndarray:
    """A JSON array of numbers, nested or not, as one float64 array: its brackets dropped, then read a slice of
    NUMBERS_SLICE bytes at a time, so that no more than one slice's numbers are ever Python objects."""
    flat = text.translate(_BRACKETS_TO_SPACES)
    parts, start = [], 0
    while start < len(flat):
        end = flat.find(b",", start + NUMBERS_SLICE)
        end = len(flat) if end < 0 else end
        try:
            parts.append(np.array(_read_numbers.decode(b"[" + flat[start:end] + b"]"), np.float64))
        except msgspec.DecodeError:
            raise InvalidInput(f"input {name[:64]!r}: data must be an array of numbers") from None
        start = end + 1
    return np.concatenate(parts) if parts else np.empty(0)


_OUTPUT_DTYPES = {"FP32": "<f4", "INT64": "<i8"}


def infer_answer(response: oip.ModelInferResponse, binary: frozenset[str], all_binary: bool
                 ) -> tuple[bytes, int | None]:
    """The body answering ``response``, and its JSON's length when raw bytes follow it (None: JSON alone). An
    output written to a shared-memory region carries its parameters and no data, as Triton answers it."""
    outputs, tail = [], []
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        parameters = {key: getattr(value, value.WhichOneof("parameter_choice"))
                      for key, value in output.parameters.items()}
        if parameters:
            entry["parameters"] = parameters
        elif all_binary or output.name in binary:
            entry["parameters"] = {BINARY_DATA_SIZE: len(raw)}
            tail.append(raw)
        else:
            entry["data"] = _json_values(output.datatype, raw)
        outputs.append(entry)
    answer: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        answer["id"] = response.id
    answer["outputs"] = outputs
    header = msgspec.json.encode(answer)
    if not tail:
        return header, None
    return b"".join((header, *tail)), len(header)


def _json_values(datatype: str, raw: bytes) -> list:
    if datatype == "BYTES":
        return [element.decode(errors="replace") for element in parse_bytes_tensor(raw, len(raw))]
    return np.frombuffer(raw, _OUTPUT_DTYPES[datatype]).tolist()
