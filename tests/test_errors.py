"""Every bad input gets its exact status code and a clear message, and the server keeps serving."""

from __future__ import annotations

import asyncio
import math
import zlib

import grpc
import numpy as np
import pytest

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from tests.helpers import encode, random_rgb, wait_for

GOOD = encode(random_rgb(5))


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as connected:
        yield connected


def raw(dtype, shape, data: bytes) -> pb.Image:
    return pb.Image(raw=pb.RawTensor(dtype=dtype, shape=shape, data=data))


BAD_REQUESTS = {
    "empty request": (pb.ClassifyRequest(), "no images"),
    "empty bytes": (pb.ClassifyRequest(images=[pb.Image(encoded=b"")]), "empty"),
    "undecodable bytes": (pb.ClassifyRequest(images=[pb.Image(encoded=b"\x89PNG garbage")]), "cannot decode"),
    "truncated jpeg": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[: len(GOOD) // 3])]), "cannot decode"),
    "raw wrong shape": (pb.ClassifyRequest(images=[raw(pb.RawTensor.UINT8, [4, 4], b"\0" * 16)]), "[H, W, 3]"),
    "raw wrong length": (pb.ClassifyRequest(images=[raw(pb.RawTensor.UINT8, [4, 4, 3], b"\0" * 47)]), "48 bytes"),
    "raw no dtype": (pb.ClassifyRequest(images=[raw(pb.RawTensor.DTYPE_UNSPECIFIED, [4, 4, 3], b"\0" * 48)]),
                     "dtype"),
    "raw float wrong shape": (pb.ClassifyRequest(images=[raw(pb.RawTensor.FLOAT32, [3, 8, 8], b"\0" * 768)]),
                              "[3, 224, 224]"),
    "raw float nan": (pb.ClassifyRequest(images=[raw(pb.RawTensor.FLOAT32, [3, 224, 224],
                                                     np.full((3, 224, 224), np.nan, np.float32).tobytes())]), "NaN"),
    "temperature zero": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], temperature=0.0), "temperature"),
    "temperature negative": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], temperature=-1.0), "temperature"),
    "temperature nan": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], temperature=math.nan), "temperature"),
    "temperature inf": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], temperature=math.inf), "temperature"),
    "top_k zero": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], top_k=0), "top_k"),
    "top_k too big": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], top_k=1001), "top_k"),
    "too many images": (pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)] * 65),
                        "images (--max-images-per-request) holds more than 64 entries"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_server_keeps_serving(server, client, name):
    request, fragment = BAD_REQUESTS[name]
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.ClassifierStub(channel).Classify(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in caught.value.details()
    (result,) = client.classify([GOOD])
    assert len(result.top_k) == 5


def test_a_request_refused_for_some_images_names_each_one_and_counts_only_them(make_server):
    running = make_server()
    images = [pb.Image(encoded=GOOD), pb.Image(encoded=b"garbage"), pb.Image(encoded=GOOD),
              raw(pb.RawTensor.UINT8, [4, 4, 3], b"\0" * 47), pb.Image(encoded=GOOD)]
    with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.ClassifierStub(channel).Classify(pb.ClassifyRequest(images=images), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().splitlines() == [
        "2 of 5 images are invalid",
        "images[1]: cannot decode image (7 bytes): not a JPEG, PNG, GIF or WEBP file",
        "images[3]: raw uint8 tensor of shape [4, 4, 3] needs 48 bytes, got 47"]
    assert ("resnet-invalid-images", "1,3") in caught.value.trailing_metadata()
    error = ClassifierError.from_rpc_error(caught.value)
    assert error.invalid_images == {1: "cannot decode image (7 bytes): not a JPEG, PNG, GIF or WEBP file",
                                    3: "raw uint8 tensor of shape [4, 4, 3] needs 48 bytes, got 47"}
    assert running.sample("resnet_images_total", device="cpu", code="INVALID_ARGUMENT") == 2
    assert running.sample("resnet_images_total", device="cpu", code="OK") == 0
    assert running.sample("resnet_requests_total", device="cpu", code="INVALID_ARGUMENT") == 1


def test_pixel_limit_refuses_large_images(make_server):
    small_limit = make_server(max_pixels=100 * 100)
    with Client(small_limit.target, timeout=60) as client:
        for image in (encode(random_rgb(1, 120, 120), "PNG"), random_rgb(1, 101, 100)):
            with pytest.raises(ClassifierError) as caught:
                client.classify([image])
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "over the limit of 10000" in caught.value.message
        (result,) = client.classify([encode(random_rgb(1, 100, 100), "PNG")])
        assert result.top_k


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose (valid, CRC-checked) header declares width x height; its pixel data is a 1x1 image's."""
    tiny = encode(np.zeros((1, 1, 3), np.uint8), "PNG")
    ihdr = b"IHDR" + width.to_bytes(4, "big") + height.to_bytes(4, "big") + tiny[24:29]
    return tiny[:12] + ihdr + zlib.crc32(ihdr).to_bytes(4, "big") + tiny[33:]


@pytest.mark.parametrize("side", [7000, 20000])
def test_decompression_bomb_is_refused_before_decoding(client, side):
    # 49 and 400 Mpx declared: refused from the header alone (a full decode would fail differently).
    with pytest.raises(ClassifierError) as caught:
        client.classify([png_claiming(side, side)])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit of 40000000" in caught.value.message


def test_full_queue_is_resource_exhausted(make_server):
    tight = make_server(max_queue=2)
    with Client(tight.target, timeout=60) as client:
        with pytest.raises(ClassifierError) as caught:
            client.classify([GOOD] * 3)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue of 2 images" in caught.value.message
        assert len(client.classify([GOOD] * 2)) == 2
    assert tight.sample("resnet_requests_total", device="cpu", code="RESOURCE_EXHAUSTED") == 1


def test_overload_is_refused_at_once_while_accepted_work_is_answered(make_server, faults):
    busy = make_server(max_queue=2, runner=faults.runner)
    faults.set("hold")  # the engine holds its batches' scores: the accepted pair keeps both slots of the queue

    async def overload():
        async with AsyncClient(busy.target, timeout=60) as client:
            accepted = asyncio.ensure_future(client.classify([GOOD, GOOD]))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: busy.sample("resnet_batches_in_flight", device="cpu") == 1)  # both slots taken
            with pytest.raises(ClassifierError) as caught:
                await client.classify([GOOD])  # answered while the accepted pair still waits
            assert not accepted.done()
            faults.clear()
            return caught.value.code, await accepted

    code, accepted = asyncio.run(overload())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(accepted) == 2 and all(result.top_k for result in accepted)


def test_bad_input_is_invalid_argument_even_when_the_queue_is_full(make_server, faults):
    busy = make_server(max_queue=2, max_images_per_request=2, runner=faults.runner)
    faults.set("hold")  # the accepted pair keeps both slots of the queue
    bad_requests = {
        "temperature": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], temperature=-1.0),
        "top_k": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)], top_k=1001),
        "empty image": pb.ClassifyRequest(images=[pb.Image(encoded=b"")]),
        "no image format": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD), pb.Image(encoded=b"garbage")]),
        "declared size": pb.ClassifyRequest(images=[pb.Image(encoded=png_claiming(10_000, 10_000))]),
        "raw length": pb.ClassifyRequest(images=[raw(pb.RawTensor.UINT8, [4, 4, 3], b"\0" * 47)]),
    }
    unknown_input = oip.ModelInferRequest(model_name="resnet18", raw_input_contents=[bytes(3)])
    unknown_input.inputs.add(name="pixels", datatype="UINT8", shape=[1, 1, 1, 3])

    async def overload():
        async with AsyncClient(busy.target, timeout=60) as client:
            accepted = asyncio.ensure_future(client.classify([GOOD, GOOD]))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: busy.sample("resnet_batches_in_flight", device="cpu") == 1)
            async with grpc.aio.insecure_channel(busy.target) as channel:
                codes = {}
                for name, request in bad_requests.items():
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await pb_grpc.ClassifierStub(channel).Classify(request, timeout=30)
                    codes[name] = caught.value.code()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(unknown_input, timeout=30)
                codes["unknown input"] = caught.value.code()
                with pytest.raises(grpc.aio.AioRpcError) as caught:  # a good one is refused: the queue is full
                    await pb_grpc.ClassifierStub(channel).Classify(pb.ClassifyRequest(images=[pb.Image(encoded=GOOD)]),
                                                                   timeout=30)
                codes["good"] = caught.value.code()
            faults.clear()
            await accepted
            return codes

    codes = asyncio.run(overload())
    assert codes == {**{name: grpc.StatusCode.INVALID_ARGUMENT for name in (*bad_requests, "unknown input")},
                     "good": grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_passed_deadline_is_deadline_exceeded(client, server):
    with pytest.raises(ClassifierError) as caught:
        client.classify([GOOD] * 8, timeout=0.001)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    (result,) = client.classify([GOOD])
    assert result.top_k


def test_unexpected_failure_is_internal_without_internals(make_server, faults):
    running = make_server(runner=faults.runner)
    faults.set("fail secret internal detail /opt/model.py line 42")
    with Client(running.target, timeout=60) as client, pytest.raises(ClassifierError) as caught:
        client.classify([GOOD])
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert "secret" not in caught.value.message and "request id" in caught.value.message
    assert running.sample("resnet_requests_total", device="cpu", code="INTERNAL") == 1


def test_a_failure_after_the_forward_pass_fails_its_batch_and_the_worker_goes_on(make_server, faults):
    running = make_server(runner=faults.runner)
    faults.set("fail-late the copy back failed")  # the forward pass ran; waiting for its scores fails
    with Client(running.target, timeout=20) as client:
        with pytest.raises(ClassifierError) as caught:
            client.classify([GOOD])
        assert caught.value.code == grpc.StatusCode.INTERNAL
        faults.clear()
        (result,) = client.classify([GOOD])
    assert len(result.top_k) == 5


def test_deadline_passing_in_the_queue_drops_the_image_before_compute(make_server):
    slow_batches = make_server(max_batch_delay_ms=1500.0)
    computed_before = slow_batches.sample("resnet_batch_size_sum", device="cpu")
    with Client(slow_batches.target) as client:
        with pytest.raises(ClassifierError) as caught:
            client.classify([GOOD], timeout=0.3)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        def dropped() -> float:
            return sum(slow_batches.sample("resnet_dropped_images_total", device="cpu", reason=reason)
                       for reason in ("cancelled", "deadline"))

        wait_for(lambda: dropped() == 1)
        assert slow_batches.sample("resnet_batch_size_sum", device="cpu") == computed_before
        assert slow_batches.sample("resnet_queue_depth", device="cpu") == 0
        (result,) = client.classify([GOOD], timeout=30)
        assert result.top_k


def test_the_message_limit_holds_for_inference_with_repository_control_on(make_server):
    """The review's N13: --model-control explicit raises gRPC's limit for a file of weights; every other method
    keeps --max-message-mb."""
    running = make_server(max_message_mb=4, model_control="explicit")
    with grpc.insecure_channel(running.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.ClassifierStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=b"\xff\xd8\xff" + bytes(6 << 20))]), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the limit of 4194304 (--max-message-mb)" in refused.value.details()
