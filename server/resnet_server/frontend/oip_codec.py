"""The Open Inference Protocol's tensors, whatever carries them: the model's names and its one input, an input
tensor split into the images the core takes, the outputs made from the core's answers, and outputs written to a
client's shared-memory regions. The gRPC servicer (resnet_server.frontend.oip_service) translates its messages
to and from these; so does an HTTP front-end.

Input ``input`` (one per request): FP32 [N, 3, 224, 224] normalised, UINT8 [N, H, W, 3] raw RGB, or BYTES [N]
encoded images, as raw bytes or typed values. Outputs: ``probabilities`` FP32 [N, 1000] and, when ``top_k`` is
asked, ``top_k_indices`` INT64, ``top_k_probabilities`` FP32 and ``top_k_labels`` BYTES, each [N, K].
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from resnet_server.common.errors import InvalidInput, NotFound
from resnet_server.common.model import MODEL_NAME
from resnet_server.common.preprocess import EncodedImage, ImageInput, RawImage
from resnet_server.common.shapes import CROP
from resnet_server.common.work import ImageOutput
from resnet_server.frontend.core import DEFAULT_TOP_K
from resnet_server.frontend.shared_memory import Region

INPUT_NAME = "input"
PROBABILITIES = "probabilities"
TOP_K_OUTPUTS = ("top_k_indices", "top_k_probabilities", "top_k_labels")
OUTPUT_TYPES = {PROBABILITIES: "FP32", "top_k_indices": "INT64", "top_k_probabilities": "FP32",
                "top_k_labels": "BYTES"}
UINT8_NAME = f"{MODEL_NAME}_uint8"
# One model, one statistics, several names; every name accepts every input form, and declares one of them (its
# datatype and shape, the batch dimension first, -1 where any size goes): tools that build requests from the
# declaration pick a form by name.
DECLARED_INPUTS = {MODEL_NAME: ("FP32", (-1, 3, CROP, CROP)), UINT8_NAME: ("UINT8", (-1, -1, -1, 3))}


class InputTensor(NamedTuple):
    """One input tensor of a request: its bytes as they came (``raw``), or its typed values (``typed``: a
    sequence of the datatype's values, for BYTES each element's bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | memoryview | None = None
    typed: Sequence = ()


class OutputTensor(NamedTuple):
    name: str
    datatype: str
    shape: list[int]
    data: bytes


def check_model(name: str, version: str, served: int) -> None:
    """The model's name, and its version if one is asked for: the weights served now (``served``)."""
    if name not in DECLARED_INPUTS:
        raise NotFound(f"unknown model {name[:64]!r}; this server serves "
                       f"{' and '.join(map(repr, DECLARED_INPUTS))}")
    if version not in ("", str(served)):
        raise NotFound(f"version {version[:64]!r} of {name} is not served; version {served} is (each reload of the "
                       "weights serves the next)")


def parse_bytes_tensor(raw: bytes | memoryview, most: int) -> list[bytes]:
    """Triton's BYTES wire format: each element is a 4-byte little-endian length, then the bytes; more than
    ``most`` elements are refused without reading on."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(elements) == most:
            raise _too_many_elements(most)
        if offset + 4 > len(raw):
            raise InvalidInput("BYTES input is malformed: a 4-byte length prefix is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput("BYTES input is malformed: an element is shorter than its length prefix")
        elements.append(bytes(raw[offset:offset + length]))  # decoders take bytes
        offset += length
    return elements


def _too_many_elements(most: int) -> InvalidInput:
    return InvalidInput(f"BYTES input holds more than {most} elements, the limit of images a request")


def serialize_bytes_tensor(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def input_images(inputs: Sequence[InputTensor], max_images: int) -> list[ImageInput]:
    """Split the request's one input tensor into per-image inputs for the core; more than ``max_images`` images
    are refused before any is made."""
    if len(inputs) != 1 or inputs[0].name != INPUT_NAME:
        names = [tensor.name[:64] for tensor in inputs[:8]]  # a flood of inputs is not echoed back
        raise InvalidInput(f"expected exactly one input named {INPUT_NAME!r}, got {len(inputs)}: {names}")
    tensor = inputs[0]
    shape = tensor.shape
    if shape and shape[0] > max_images:
        raise InvalidInput(f"input declares {shape[0]} images, over the limit of {max_images} "
                           "(--max-images-per-request)")
    if tensor.datatype == "BYTES":
        return _bytes_images(shape, tensor.raw, tensor.typed, max_images)
    if tensor.datatype == "UINT8":
        return _array_images(shape, tensor.raw, tensor.typed, np.uint8, "uint8", 4)
    if tensor.datatype == "FP32":
        return _array_images(shape, tensor.raw, tensor.typed, np.float32, "float32", 4)
    raise InvalidInput(f"input datatype must be FP32, UINT8 or BYTES, got {tensor.datatype[:16]!r}")


def _bytes_images(shape: tuple[int, ...], raw: bytes | memoryview | None, typed: Sequence, max_images: int
                  ) -> list[ImageInput]:
    if len(shape) != 1:
        raise InvalidInput(f"BYTES input must have shape [N], got {list(shape)}")
    if raw is None and len(typed) > max_images:  # counted before they are listed
        raise _too_many_elements(max_images)
    elements = parse_bytes_tensor(raw, max_images) if raw is not None else list(typed)
    if len(elements) != shape[0]:
        raise InvalidInput(f"BYTES input declares shape {list(shape)} but holds {len(elements)} elements")
    return [EncodedImage(element) for element in elements]


def _array_images(shape, raw, typed, np_type, dtype: str, ndim: int) -> list[ImageInput]:
    """``typed``: the tensor's typed values, read only when ``raw`` is None and then in one NumPy conversion, not
    a Python loop over them."""
    expected = "[N, 3, 224, 224]" if dtype == "float32" else "[N, H, W, 3]"
    if len(shape) != ndim or min(shape, default=0) <= 0:
        raise InvalidInput(f"{dtype} input must have shape {expected}, got {list(shape)}")
    if dtype == "float32" and tuple(shape[1:]) != (3, CROP, CROP):
        raise InvalidInput(f"FP32 input must have shape {expected}, got {list(shape)}")
    count = math.prod(shape)
    if raw is None:
        if len(typed) != count:
            raise InvalidInput(f"input of shape {list(shape)} needs {count} values, got {len(typed)}")
        values = np.array(typed, dtype=np.float32 if dtype == "float32" else np.uint32)
        if dtype == "uint8" and values.size and values.max() > 255:
            raise InvalidInput("UINT8 input holds values above 255")
        raw = values.astype(np_type).tobytes()
    itemsize = np.dtype(np_type).itemsize
    if len(raw) != count * itemsize:
        raise InvalidInput(f"input of shape {list(shape)} needs {count * itemsize} bytes, got {len(raw)}")
    per_image = len(raw) // shape[0]
    return [RawImage(dtype, tuple(shape[1:]), raw[i * per_image:(i + 1) * per_image]) for i in range(shape[0])]


def requested_outputs(names: list[str], top_k_asked: bool) -> list[str]:
    """The outputs asked for by name, or by default: the probabilities, and the top-k ones when top_k is."""
    for name in names:
        if name not in OUTPUT_TYPES:
            raise InvalidInput(f"unknown output {name[:64]!r}; outputs are {list(OUTPUT_TYPES)}")
    if names:
        return names
    return [PROBABILITIES, *TOP_K_OUTPUTS] if top_k_asked else [PROBABILITIES]


def top_k_for(top_k: int | None, names: list[str]) -> int | None:
    """The top_k asked for, or the default one when only a top-k output is."""
    if top_k is None and any(name in TOP_K_OUTPUTS for name in names):
        return DEFAULT_TOP_K
    return top_k


def output_tensors(outputs: list[ImageOutput], names: list[str], labels: list[str]) -> list[OutputTensor]:
    """The outputs ``names`` of a call's answers, as raw little-endian bytes (BYTES in Triton's format)."""
    batch = len(outputs)
    k = len(outputs[0].top_k)
    tensors = []
    for name in names:
        if name == PROBABILITIES:
            shape, data = [batch, len(outputs[0].probabilities)], _stack_probabilities(outputs)
        elif name == "top_k_indices":
            shape, data = [batch, k], np.array([[i for i, _ in o.top_k] for o in outputs], "<i8").tobytes()
        elif name == "top_k_probabilities":
            shape, data = [batch, k], np.array([[p for _, p in o.top_k] for o in outputs], "<f4").tobytes()
        else:
            shape = [batch, k]
            data = serialize_bytes_tensor([labels[i].encode() for o in outputs for i, _ in o.top_k])
        tensors.append(OutputTensor(name, OUTPUT_TYPES[name], shape, data))
    return tensors


def answered_version(outputs: list[ImageOutput]) -> int:
    """The weights' version a call's answer names: one, unless a reload split the call (then the newest)."""
    return max(output.weights_version for output in outputs)


def _stack_probabilities(outputs: list[ImageOutput]) -> bytes:
    return np.stack([output.probabilities for output in outputs]).astype("<f4").tobytes()


class RegionOutput(NamedTuple):
    """Where an output asked for in a client's shared-memory region is to go: the region, the offset, the bytes
    there."""

    region: Region
    offset: int
    room: int


# An image's bytes of each output of a fixed size.
FIXED_OUTPUT_BYTES = {PROBABILITIES: lambda k: 1000 * 4, "top_k_indices": lambda k: k * 8,
                      "top_k_probabilities": lambda k: k * 4}


def check_room(name: str, needed: int, room: int) -> None:
    if needed > room:
        raise InvalidInput(f"output {name!r} needs {needed} bytes; its shared-memory reference gives {room}")


def check_rooms_before_compute(into: dict[str, RegionOutput], images: int, top_k: int | None) -> None:
    """The outputs of a known size checked against their regions before the images are computed (the labels'
    size is known only after)."""
    for name, place in into.items():
        if name in FIXED_OUTPUT_BYTES:
            check_room(name, images * FIXED_OUTPUT_BYTES[name](top_k or DEFAULT_TOP_K), place.room)


def write_to_regions(tensors: list[OutputTensor], into: dict[str, RegionOutput]) -> None:
    """Each output asked for in a region written there, every room checked before any is written."""
    for tensor in tensors:
        if tensor.name in into:
            check_room(tensor.name, len(tensor.data), into[tensor.name].room)
    for tensor in tensors:
        if (place := into.get(tensor.name)) is not None:
            place.region.write(place.offset, tensor.data)
