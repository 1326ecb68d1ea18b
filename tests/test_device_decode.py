"""--decode-on-device: JPEGs decoded in batches by the replica (nvjpeg on CUDA; exercised here on the CPU).

Same answers as the CPU path, an undecodable JPEG fails alone in its batch, and other input
kinds in the same request still work.
"""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_server.common.device_decode import DeferredJpeg, decode_batch
from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import decode, transform
from tests.helpers import encode, random_rgb

JPEGS = [encode(random_rgb(seed)) for seed in (31, 32, 33)]
NOT_A_JPEG = b"\xff\xd8\xff" + b"no image follows this marker" * 4


def cmyk_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(random_rgb(34)).convert("CMYK").save(buffer, format="JPEG")
    return buffer.getvalue()


def test_decode_batch_matches_the_cpu_path_and_rejects_only_the_bad_image():
    images = [JPEGS[0], NOT_A_JPEG, cmyk_jpeg(), JPEGS[1]]
    results = decode_batch([DeferredJpeg.of(data, 40_000_000) for data in images], torch.device("cpu"))
    assert isinstance(results[1], InvalidInput) and "cannot decode" in str(results[1])
    for index in (0, 2, 3):
        expected = transform(decode(images[index], 10**8))
        torch.testing.assert_close(results[index], expected, atol=0, rtol=0)


def test_jpegs_decoded_by_the_replica_match_torchvision_and_other_kinds_still_work(make_server, reference):
    running = make_server(decode_on_device="true")
    assert running.app.engines[0].decode_on_device
    png = encode(random_rgb(35), "PNG")
    pixels = random_rgb(36)
    with Client(running.target) as client:
        results = client.classify([*JPEGS, png, pixels], full=True)
    expected_inputs = [reference.input_from_bytes(data) for data in (*JPEGS, png)]
    expected_inputs.append(reference.input_from_array(pixels))
    for result, model_input in zip(results, expected_inputs, strict=True):
        np.testing.assert_allclose(result.probabilities, reference.probabilities(model_input), atol=1e-5, rtol=0)
    assert running.sample("resnet_batch_size_count", device="cpu") == 1  # one request, one batch


def test_an_undecodable_jpeg_fails_alone_and_its_batch_is_answered(make_server, reference):
    running = make_server(decode_on_device="true", max_batch_delay_ms=500.0)

    async def fire():
        async with AsyncClient(running.target, timeout=60) as client:
            calls = [client.classify([data], full=True) for data in (JPEGS[0], NOT_A_JPEG, JPEGS[1], JPEGS[2])]
            return await asyncio.gather(*calls, return_exceptions=True)

    good_a, bad, good_b, good_c = asyncio.run(fire())
    assert isinstance(bad, ClassifierError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode" in bad.message
    for (result,), data in zip((good_a, good_b, good_c), (JPEGS[0], JPEGS[1], JPEGS[2]), strict=True):
        expected = reference.probabilities(reference.input_from_bytes(data))
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)
    # The four shared one batch window; the bad image was left out before the forward pass.
    assert running.sample("resnet_batch_size_count", device="cpu") == 1
    assert running.sample("resnet_batch_size_sum", device="cpu") == 3


@pytest.mark.parametrize("data, fragment", [(b"", "empty"), (JPEGS[0][: len(JPEGS[0]) // 3], "cannot decode")])
def test_bad_jpegs_are_invalid_argument_on_the_device_path(make_server, data, fragment):
    running = make_server(decode_on_device="true")
    with Client(running.target) as client:
        with pytest.raises(ClassifierError) as caught:
            client.classify([data])
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in caught.value.message
        assert client.classify([JPEGS[0]])[0].top_k  # and it keeps serving


def test_cpu_replicas_decode_on_the_request_path_by_default(server):
    assert server.app.engines[0].decode_on_device is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvjpeg_batches_on_cuda_answer_like_the_cpu_path_and_gauges_report(make_server, reference):
    running = make_server(devices=("cuda:0",))
    replica = running.app.engines[0]
    assert replica.decode_on_device  # auto: on for CUDA
    with Client(running.target) as client:
        results = client.classify(JPEGS, full=True)
    for result, data in zip(results, JPEGS, strict=True):
        assert result.device == "cuda:0"
        # nvjpeg and the GPU resize round differently from libjpeg-turbo: close, not identical.
        expected = reference.probabilities(reference.input_from_bytes(data))
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-2, rtol=0)
    assert running.sample("resnet_gpu_memory_allocated_bytes", device="cuda:0") > 0
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return
    utilisation = running.metrics.registry.get_sample_value("resnet_gpu_utilization_ratio", {"device": "cuda:0"})
    assert utilisation is not None and 0.0 <= utilisation <= 1.0
