"""Raw tensors: checked on arrival, converted later with their batch on the replica's thread.

Whatever shapes and dtypes share a batch, each image gets the answer it would get alone, and a
float32 image holding NaN fails alone, on arrival, while the calls beside it are answered.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from resnet_client import AsyncClient, ClassifierError
from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import (
    STD,
    CroppedImage,
    RawImage,
    check_raw,
    cropped_batch,
    raw_batch,
    transform,
    whole_batch,
)
from resnet_server.engine.runner import ModelRunner
from tests.helpers import random_rgb


def raw_uint8(pixels: np.ndarray) -> RawImage:
    return RawImage("uint8", pixels.shape, pixels.tobytes())


def raw_float(values: np.ndarray) -> RawImage:
    return RawImage("float32", values.shape, values.astype(np.float32).tobytes())


def test_a_mixed_batch_converts_each_image_as_it_would_alone():
    small, large = random_rgb(41, 224, 224), random_rgb(42, 480, 640)
    finite = np.random.default_rng(43).standard_normal((3, 224, 224))
    flipped = small[::-1].copy()
    images = [raw_uint8(small), raw_float(finite), raw_uint8(large), raw_uint8(flipped)]
    results = raw_batch(images, torch.device("cpu"))
    for index, pixels in ((0, small), (2, large), (3, flipped)):
        alone = transform(torch.from_numpy(pixels).permute(2, 0, 1))
        torch.testing.assert_close(results[index], alone, atol=0, rtol=0)
    torch.testing.assert_close(results[1], torch.from_numpy(finite.astype(np.float32)), atol=0, rtol=0)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0, 0), (1, 5, 7), (2, 223, 223)])
def test_check_raw_refuses_a_float_image_holding_nan_or_infinity(value, where):
    values = np.random.default_rng(49).standard_normal((3, 224, 224)).astype(np.float32)
    check_raw(raw_float(values), max_pixels=10_000_000)  # finite: passes
    values[where] = value
    with pytest.raises(InvalidInput, match="NaN or infinity"):
        check_raw(RawImage("float32", values.shape, memoryview(values.tobytes())), max_pixels=10_000_000)


@pytest.mark.parametrize("ready", [False, True], ids=["raw, converted whole", "float rows, stacked"])
def test_consecutive_batches_of_any_size_come_out_whole_in_the_model_layout(ready):
    """A smaller batch after a larger one, and a larger one after that, each holds exactly its own images,
    channels-last: raw images converted as one batch, and ready float rows (a CPU engine's, preprocessed by the
    front-ends) stacked into the one buffer the runner keeps, which grows."""
    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"))
    pixels = [random_rgb(50 + seed, 224, 224) for seed in range(6)]
    for batch in ([0, 1, 2], [3], [0, 1, 2, 3, 4, 5]):
        rows = [transform(torch.from_numpy(pixels[i]).permute(2, 0, 1)) for i in batch]
        inputs, errors = runner.prepare(rows if ready else [raw_uint8(pixels[i]) for i in batch])
        assert errors == {}
        expected = torch.stack(rows)
        torch.testing.assert_close(inputs, expected, atol=0, rtol=0)
        assert inputs.is_contiguous(memory_format=torch.channels_last)


def test_a_batch_of_one_kind_and_shape_converts_whole_as_its_images_would_one_by_one():
    cpu = torch.device("cpu")
    pixels = [random_rgb(60 + seed, 240, 320) for seed in range(3)]
    raw = [raw_uint8(p) for p in pixels]
    torch.testing.assert_close(whole_batch(raw, cpu), torch.stack(raw_batch(raw, cpu)), atol=0, rtol=0)
    floats = [raw_float(np.random.default_rng(seed).standard_normal((3, 224, 224))) for seed in range(2)]
    torch.testing.assert_close(whole_batch(floats, cpu), torch.stack(raw_batch(floats, cpu)), atol=0, rtol=0)
    crops = [CroppedImage(random_rgb(70 + seed, 224, 224).tobytes()) for seed in range(2)]
    torch.testing.assert_close(whole_batch(crops, cpu), torch.stack(cropped_batch(crops, cpu)), atol=0, rtol=0)
    # Two shapes, two dtypes or two kinds: not one conversion; each kind converts apart.
    assert whole_batch([raw[0], raw_uint8(random_rgb(1, 224, 224))], cpu) is None
    assert whole_batch([raw[0], floats[0]], cpu) is None
    assert whole_batch([crops[0], raw[0]], cpu) is None
    assert whole_batch([raw[0], crops[0]], cpu) is None


@pytest.mark.parametrize("image, fragment", [
    (RawImage("uint8", (224, 224, 4), bytes(224 * 224 * 4)), "shape [H, W, 3]"),
    (RawImage("uint8", (224, 224, 3), bytes(10)), "needs 150528 bytes, got 10"),
    (RawImage("uint8", (5000, 5000, 3), b""), "over the limit"),
    (RawImage("float32", (3, 224, 224), bytes(7)), "needs 602112 bytes"),
    (RawImage("int16", (224, 224, 3), b""), "uint8 or float32"),
])
def test_check_raw_refuses_without_reading_pixels(image, fragment):
    with pytest.raises(InvalidInput, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        check_raw(image, max_pixels=10_000_000)


def test_a_nan_image_fails_alone_and_its_batch_is_answered(make_server, reference):
    running = make_server(max_batch_delay_ms=500.0)  # the four requests share one batch window
    small, large = random_rgb(44, 224, 224), random_rgb(45, 240, 320)
    good_float = reference.input_from_array(random_rgb(46))
    nan_float = np.full((3, 224, 224), np.nan, np.float32)

    async def fire():
        async with AsyncClient(running.target, timeout=60) as client:
            calls = [client.classify([image], full=True) for image in (small, nan_float, large, good_float.numpy())]
            return await asyncio.gather(*calls, return_exceptions=True)

    first, bad, second, third = asyncio.run(fire())
    assert isinstance(bad, ClassifierError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN or infinity" in bad.message
    expected = [reference.input_from_array(small), reference.input_from_array(large), good_float]
    for (result,), model_input in zip((first, second, third), expected, strict=True):
        np.testing.assert_allclose(result.probabilities, reference.probabilities(model_input), atol=1e-5, rtol=0)
    assert running.sample("resnet_batch_size_count", device="cpu") == 1
    assert running.sample("resnet_batch_size_sum", device="cpu") == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_raw_images_convert_on_the_gpu_as_on_the_cpu():
    images = [raw_uint8(random_rgb(47, 480, 640)), raw_float(np.random.default_rng(48).standard_normal((3, 224, 224)))]
    on_gpu = raw_batch(images, torch.device("cuda:0"))
    on_cpu = raw_batch(images, torch.device("cpu"))
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert gpu.device.type == "cuda" and gpu.shape == cpu.shape == (3, 224, 224)
        # The GPU resize works in float and rounds back to uint8: at most one grey level apart.
        assert (gpu.cpu() - cpu).abs().max().item() <= 1.0 / 255.0 / min(STD) + 1e-5
