"""JPEG decoding in batches on the replica's own device (nvjpeg on CUDA), then the ImageNet transform there.

With ``--decode-on-device`` the request path only checks each JPEG's header on the CPU (the pixel
limit, against decompression bombs) and hands its bytes over as a :class:`DeferredJpeg`. The
replica decodes a whole batch of them with one ``decode_jpeg`` call and resizes, crops and
normalises each on the device, so a GPU server's CPU never touches the pixels. ``decode_jpeg``
has no partial results: when the batch call fails, each image is retried alone, then with the
CPU decoders (which read what nvjpeg cannot, e.g. CMYK); an image nothing can read fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from resnet_server.common.errors import InvalidInput
from resnet_server.common.image_header import JPEG_MAGIC
from resnet_server.common.preprocess import EncodedImage, ImageInput, check_header, decode, preprocess, transform


@dataclass(frozen=True, eq=False)
class DeferredJpeg:
    """JPEG bytes whose header passed the CPU checks; decoded later, with its batch, on the device, and checked
    against the pixel limit again there (the engine decodes nothing unchecked)."""

    data: torch.Tensor  # uint8 [N] on the CPU, as decode_jpeg takes it
    max_pixels: int

    @classmethod
    def of(cls, data: bytes, max_pixels: int) -> DeferredJpeg:
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), max_pixels)


def defer_or_preprocess(image: ImageInput, max_pixels: int, crop_only: bool = False) -> torch.Tensor | DeferredJpeg:
    """JPEGs are checked now and decoded later on the device; other encoded images are decoded now."""
    if isinstance(image, EncodedImage) and image.data[:3] == JPEG_MAGIC:
        check_header(image.data, max_pixels)
        return DeferredJpeg.of(image.data, max_pixels)
    return preprocess(image, max_pixels, crop_only)


def decode_batch(images: list[DeferredJpeg], device: torch.device) -> list[torch.Tensor | InvalidInput]:
    """Each image as the model's float [3, 224, 224] input on ``device``, or the error that rejects it. Each
    header is checked against its pixel limit first, and each decoded size after."""
    results: list = [_refusal(image) for image in images]
    checked = [image for image, refusal in zip(images, results, strict=True) if refusal is None]
    try:
        decoded: list = decode_jpeg([image.data for image in checked], mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one bad image fails the whole call: find it
        decoded = [_decode_one(image, device) for image in checked]
    answers = iter(zip(checked, decoded, strict=True))
    for index, refusal in enumerate(results):
        if refusal is None:
            image, pixels = next(answers)
            results[index] = _within_limit(pixels, image.max_pixels)
    return [transform(result) if isinstance(result, torch.Tensor) else result for result in results]


def _refusal(image: DeferredJpeg) -> InvalidInput | None:
    try:
        check_header(image.data.numpy().tobytes(), image.max_pixels)
    except InvalidInput as exc:
        return exc
    return None


def _within_limit(pixels: torch.Tensor | InvalidInput, max_pixels: int) -> torch.Tensor | InvalidInput:
    if isinstance(pixels, torch.Tensor) and pixels.shape[-2] * pixels.shape[-1] > max_pixels:
        return InvalidInput(f"image decodes to {pixels.shape[-1]}x{pixels.shape[-2]} pixels, over the limit of "
                            f"{max_pixels}")
    return pixels


def _decode_one(image: DeferredJpeg, device: torch.device) -> torch.Tensor | InvalidInput:
    try:
        return decode_jpeg(image.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    try:  # the CPU decoders, under the same limit
        return decode(image.data.numpy().tobytes(), image.max_pixels).to(device)
    except InvalidInput as exc:
        return exc
