"""Faults, out-of-memory splitting, cancellation, and property-based checks of request validation."""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import EncodedImage, RawImage, preprocess
from tests.helpers import encode, random_rgb, wait_for

IMAGE = encode(random_rgb(12))


def test_out_of_memory_batch_is_split_and_every_request_answered(make_server, faults, reference):
    running = make_server(max_batch_delay_ms=300.0, runner=faults.runner)
    faults.set("oom-above 2")  # a "device" with room for two images a pass
    images = [encode(random_rgb(600 + i)) for i in range(6)]

    async def fire():
        async with AsyncClient(running.target, timeout=60) as client:
            return await asyncio.gather(*(client.classify([image], full=True) for image in images))

    results = asyncio.run(fire())
    # One batch of all six (the delay gathered them), too big for the "device", computed in pieces of two at most.
    assert running.sample("resnet_batch_size_count", device="cpu") == 1
    assert running.sample("resnet_batch_size_sum", device="cpu") == 6
    for image, (result,) in zip(images, results, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


def test_out_of_memory_on_a_single_image_is_resource_exhausted(make_server, faults):
    running = make_server(runner=faults.runner)
    faults.set("oom")
    with Client(running.target) as client, pytest.raises(ClassifierError) as caught:
        client.classify([IMAGE])
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert running.app.engines[0].healthy  # memory pressure is not a broken device


def test_cancelled_call_frees_its_queue_slots_and_is_counted(make_server):
    running = make_server(max_batch_delay_ms=5000.0, max_batch_size=64)

    async def cancel_while_queued():
        async with AsyncClient(running.target, timeout=60) as client:
            call = asyncio.ensure_future(client.classify([IMAGE] * 3))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: running.sample("resnet_queue_depth", device="cpu") == 3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(cancel_while_queued())
    wait_for(lambda: running.sample("resnet_dropped_images_total", device="cpu", reason="cancelled") == 3)
    assert running.sample("resnet_queue_depth", device="cpu") == 0
    assert running.sample("resnet_requests_total", device="cpu", code="CANCELLED") == 1


# --- properties: any input gives a correct answer or INVALID_ARGUMENT, never anything else ---

raw_images = st.builds(
    RawImage,
    dtype=st.sampled_from(["uint8", "float32", "", "int16"]),
    shape=st.lists(st.integers(-2, 300), min_size=0, max_size=4).map(tuple),
    data=st.binary(max_size=2048),
)


@settings(max_examples=300, deadline=None)
@given(image=st.one_of(st.builds(EncodedImage, st.binary(max_size=4096)), raw_images))
def test_preprocess_accepts_or_raises_invalid_input_only(image):
    try:
        tensor = preprocess(image, max_pixels=300 * 300)
    except InvalidInput:
        return
    assert tensor.shape == (3, 224, 224) and tensor.dtype == torch.float32


@settings(max_examples=100, deadline=None)
@given(side=st.integers(1, 64), other=st.integers(1, 64), fmt=st.sampled_from(["PNG", "JPEG", "GIF", "WEBP"]))
def test_any_small_valid_image_decodes(side, other, fmt):
    tensor = preprocess(EncodedImage(encode(random_rgb(side, side, other), fmt)), max_pixels=10_000)
    assert tensor.shape == (3, 224, 224) and torch.isfinite(tensor).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
       top_k=st.one_of(st.none(), st.integers(-5, 1100)),
       data=st.one_of(st.just(IMAGE), st.binary(max_size=64)))
def test_requests_over_grpc_are_answered_or_invalid_never_internal(server, temperature, top_k, data):
    request = pb.ClassifyRequest(images=[pb.Image(encoded=data)])
    if temperature is not None:
        request.temperature = temperature
    if top_k is not None:
        request.top_k = top_k
    valid = (data == IMAGE and (temperature is None or (math.isfinite(temperature) and temperature > 0))
             and (top_k is None or 1 <= top_k <= 1000))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ClassifierStub(channel)
        try:
            response = stub.Classify(request, timeout=60)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and not valid, error.details()
            return
    assert valid
    (result,) = response.results
    assert len(result.top_k) == (5 if top_k is None else top_k)
    assert all(math.isfinite(score.probability) for score in result.top_k)
