"""JPEG decoding in batches on the replica's own device (nvjpeg on CUDA), then the ImageNet transform there.

With ``--decode-on-device`` the request path only checks each JPEG's header on the CPU (the pixel
limit, against decompression bombs) and hands its bytes over as a :class:`DeferredJpeg`. The
replica decodes a whole batch of them with one ``decode_jpeg`` call and resizes, crops and
normalises each on the device, so a GPU server's CPU never touches the pixels. ``decode_jpeg``
has no partial results: when the batch call fails, each image is retried alone, then with the
CPU decoders (which read what nvjpeg cannot, e.g. CMYK); an image nothing can read fails alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import EncodedImage, ImageInput, check_header, decode, preprocess, transform

JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass(frozen=True, eq=False)
class DeferredJpeg:
    """JPEG bytes whose header passed the CPU checks; decoded later, with its batch, on the device."""

    data: torch.Tensor  # uint8 [N] on the CPU, as decode_jpeg takes it

    @classmethod
    def of(cls, data: bytes) -> DeferredJpeg:
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def defer_or_preprocess(image: ImageInput, max_pixels: int, crop_only: bool = False) -> torch.Tensor | DeferredJpeg:
    """JPEGs are checked now and decoded later on the device; other encoded images are decoded now."""
    if isinstance(image, EncodedImage) and image.data[:3] == JPEG_MAGIC:
        check_header(image.data, max_pixels)
        return DeferredJpeg.of(image.data)
    return preprocess(image, max_pixels, crop_only)


def decode_batch(images: list[DeferredJpeg], device: torch.device) -> list[torch.Tensor | InvalidInput]:
    """Each image as the model's float [3, 224, 224] input on ``device``, or the error that rejects it."""
    try:
        decoded: list = decode_jpeg([image.data for image in images], mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one bad image fails the whole call: find it
        decoded = [_decode_one(image, device) for image in images]
    return [transform(image) if isinstance(image, torch.Tensor) else image for image in decoded]


def _decode_one(image: DeferredJpeg, device: torch.device) -> torch.Tensor | InvalidInput:
    try:
        return decode_jpeg(image.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    try:  # the CPU decoders; the pixel limit was checked on arrival
        return decode(image.data.numpy().tobytes(), sys.maxsize).to(device)
    except InvalidInput as exc:
        return exc
