"""Request building and result parsing shared by Client and AsyncClient (no torch, no numpy)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .api import classifier_pb2 as pb

# A path, encoded bytes, or an array with .dtype/.shape/.tobytes(): uint8 [H, W, 3] or float32 [3, 224, 224].
ImageLike = Any  # str | os.PathLike | bytes | array; Any because arrays are duck-typed
_RAW_DTYPES = {"uint8": pb.RawTensor.UINT8, "float32": pb.RawTensor.FLOAT32}


@dataclass(frozen=True)
class ClassScore:
    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Classification:
    top_k: list[ClassScore]
    probabilities: list[float] | None
    logits: list[float] | None
    device: str
    temperature: float
    queue_ms: float
    compute_ms: float
    trace_id: str = ""  # of the server's span for the call, when it traces (resnet-client classify --trace)


def to_image(image: ImageLike) -> pb.Image:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return pb.Image(encoded=bytes(image))
    if isinstance(image, (str, os.PathLike)):
        return pb.Image(encoded=Path(image).read_bytes())
    if hasattr(image, "dtype") and hasattr(image, "shape") and hasattr(image, "tobytes"):
        dtype = _RAW_DTYPES.get(str(image.dtype), pb.RawTensor.DTYPE_UNSPECIFIED)
        return pb.Image(raw=pb.RawTensor(dtype=dtype, shape=list(image.shape), data=image.tobytes()))
    raise TypeError(f"cannot send {type(image).__name__} as an image: use a path, bytes or an array")


def build_request(images: Iterable[ImageLike], *, top_k: int | None = None, temperature: float | None = None,
                  full: bool = False, logits: bool = False, priority: int = 0) -> pb.ClassifyRequest:
    request = pb.ClassifyRequest(images=[to_image(image) for image in images],
                                 return_probabilities=full, return_logits=logits, priority=priority)
    if top_k is not None:
        request.top_k = top_k
    if temperature is not None:
        request.temperature = temperature
    return request


def parse_response(response: pb.ClassifyResponse, trace_id: str = "") -> list[Classification]:
    return [
        Classification(
            top_k=[ClassScore(score.index, score.label, score.probability) for score in result.top_k],
            probabilities=list(result.probabilities) or None,
            logits=list(result.logits) or None,
            device=result.device,
            temperature=result.temperature,
            queue_ms=result.queue_ms,
            compute_ms=result.compute_ms,
            trace_id=trace_id,
        )
        for result in response.results
    ]
