"""The served transform against torchvision's v1 ImageNet preset it stands in for, and the v2 pipeline it fuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.models import ResNet18_Weights

from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import (
    STD,
    CroppedImage,
    EncodedImage,
    RawImage,
    cropped_batch,
    decode,
    preprocess,
    transform,
)
from resnet_server.common.shapes import CROP_SHAPE, FLOAT_SHAPE
from tests.helpers import encode, random_rgb

ONE_GREY_LEVEL = 1.0 / 255.0 / min(STD)  # in normalised units


@pytest.mark.parametrize("height, width", [(224, 224), (480, 640), (301, 257), (100, 900)])
@pytest.mark.parametrize("layout", ["hwc", "chw"])  # raw uint8 arrives HWC; decoders return CHW
def test_v2_transform_is_the_v1_preset_within_one_grey_level(height, width, layout):
    pixels = torch.from_numpy(random_rgb(height * width, height, width)).permute(2, 0, 1)
    if layout == "chw":
        pixels = pixels.contiguous()
    served, v1 = transform(pixels), ResNet18_Weights.IMAGENET1K_V1.transforms()(pixels)
    assert served.shape == v1.shape == (3, 224, 224) and served.dtype == torch.float32
    assert (served - v1).abs().max().item() <= ONE_GREY_LEVEL + 1e-6
    assert (served - v1).abs().mean().item() < ONE_GREY_LEVEL / 4  # most pixels are identical


@pytest.mark.parametrize("height, width", [(224, 224), (480, 640), (301, 257)])
def test_fused_normalisation_is_the_v2_pipeline_batched_or_not(height, width, reference):
    images = torch.stack([torch.from_numpy(random_rgb(seed, height, width)).permute(2, 0, 1) for seed in (1, 2)])
    expected = torch.stack([reference.transform(image) for image in images])  # v2 Resize .. ToDtype, Normalize
    torch.testing.assert_close(transform(images), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(transform(images[1]), expected[1], atol=2e-6, rtol=0)


@pytest.mark.parametrize(("data", "message"), [
    (encode(random_rgb(7))[:4000], "cannot decode JPEG image (4000 bytes): Image is incomplete or truncated"),
    (encode(random_rgb(8), "PNG")[:300], "cannot decode PNG image (300 bytes): "),
    (b"\x89PNG garbage", "cannot decode image (12 bytes): not a JPEG, PNG, GIF or WEBP file"),
    (b"not an image at all", "cannot decode image (19 bytes): not a JPEG, PNG, GIF or WEBP file"),
])
def test_a_broken_image_of_a_known_format_says_what_the_decoder_found(data, message):
    with pytest.raises(InvalidInput) as refused:
        decode(data, max_pixels=10_000_000)
    assert str(refused.value).startswith(message)
    assert "not a JPEG" not in str(refused.value) or message.endswith("WEBP file")


def test_a_crop_normalised_with_its_batch_is_the_image_preprocessed_in_one_go():
    """What a front-end hands an engine for an image it decodes (the uint8 crop, a quarter of the float input's
    bytes) and what the engine makes of it (normalised with its batch) equal the whole preprocessing; a float32
    image is the model's input already."""
    side = (300, 400)
    jpeg = EncodedImage(encode(random_rgb(61, *side)))
    raw = RawImage("uint8", (*side, 3), random_rgb(62, *side).tobytes())
    for image in (jpeg, raw):
        cropped = preprocess(image, 10**8, crop_only=True)
        assert cropped.dtype == torch.uint8 and cropped.shape == CROP_SHAPE and cropped.is_contiguous()
        batch = cropped_batch([CroppedImage(cropped.numpy().tobytes())] * 2, torch.device("cpu"))
        for row in batch:
            torch.testing.assert_close(row, preprocess(image, 10**8), atol=1e-6, rtol=0)
    floats = np.random.default_rng(63).standard_normal(FLOAT_SHAPE).astype(np.float32)
    as_given = preprocess(RawImage("float32", FLOAT_SHAPE, floats.tobytes()), 10**8, crop_only=True)
    torch.testing.assert_close(as_given, torch.from_numpy(floats), atol=0, rtol=0)
