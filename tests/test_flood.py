"""One crafted request must not stall a front-end, nor cost an engine memory out of proportion, nor get an image
decoded past the pixel limit: floods of empty fields are refused unread, a caller's id is cut to 64 printable
characters, and a JPEG's size is read from its frame header even where PIL cannot read it."""

from __future__ import annotations

import asyncio
import io
import logging
import struct
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.common.device_decode import DeferredJpeg, decode_batch, defer_or_preprocess
from resnet_server.common.errors import InvalidInput
from resnet_server.common.image_header import declared_size
from resnet_server.common.preprocess import EncodedImage, check_header, preprocess
from resnet_server.frontend.classify_request import read_classify_request
from resnet_server.frontend.oip_service import read_infer_request
from tests.helpers import encode, random_rgb

CLASSIFY = "/resnet.v1.Classifier/Classify"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_LOAD = "/inference.GRPCInferenceService/RepositoryModelLoad"
MIB = 1 << 20
# A generous bound for refusing what today takes seconds: the reader walks at most a few hundred fields.
REFUSED_WITHIN = 0.5


def empty_images(size: int) -> bytes:
    return b"\x0a\x00" * (size // 2)  # ClassifyRequest.images, each an empty Image


def bytes_tensor_of_empty_elements(size: int) -> bytes:
    request = oip.ModelInferRequest(model_name="resnet18")
    request.inputs.add(name="input", datatype="BYTES", shape=[size // 4])
    request.raw_input_contents.append(bytes(size))  # every element's length is 0
    return request.SerializeToString()


def tiny_files(size: int) -> bytes:
    """RepositoryModelLoadRequest.parameters, each entry a file: key "file:" and an empty value."""
    entry = b"\x0a\x05file:\x12\x00"
    return (b"\x1a" + bytes([len(entry)]) + entry) * (size // (len(entry) + 2))


FLOODS = {
    "Classify: empty images": (CLASSIFY, empty_images(4 * MIB),
                               "ClassifyRequest.images (--max-images-per-request) holds more than 64 entries"),
    "Classify: unknown fields": (CLASSIFY, b"\x78\x00" * (2 * MIB), "the request holds more than 4096 fields"),
    "Classify: fields inside one image": (CLASSIFY, b"\x0a\x80\x80\x80\x02" + b"\x78\x00" * (2 * MIB),
                                          "the request holds more than 4096 fields"),
    "ModelInfer: empty raw contents": (MODEL_INFER, b"\x3a\x00" * (2 * MIB),
                                       "raw_input_contents holds more than 8 entries"),
    "ModelInfer: empty inputs": (MODEL_INFER, b"\x2a\x00" * (2 * MIB),
                                 "ModelInferRequest.inputs holds more than 64 entries"),
    "ModelInfer: a BYTES tensor of empty elements": (MODEL_INFER, bytes_tensor_of_empty_elements(4 * MIB),
                                                     "input declares 1048576 images, over the limit of 64"),
    # Bounded before the handler would say the repository is closed (the server runs without
    # --model-control explicit).
    "RepositoryModelLoad: tiny files": (MODEL_LOAD, tiny_files(4 * MIB),
                                        "RepositoryModelLoadRequest.parameters holds more than 64 entries"),
}


def test_the_reader_stops_at_the_image_limit():
    started = time.monotonic()
    read = read_classify_request(empty_images(4 * MIB), max_images=64)
    assert time.monotonic() - started < REFUSED_WITHIN
    assert read.images == [] and read.unreadable == "request has more than 64 images, the limit of 64 " \
                                                    "(--max-images-per-request)"
    assert len(read_classify_request(empty_images(2 * 64), max_images=64).images) == 64  # the limit itself is read


def test_a_small_request_the_walk_gives_up_on_still_goes_to_protobuf():
    group_then_images = b"\x4b\x4c" + empty_images(2 * 3)  # an empty group (field 9): protobuf keeps it
    assert len(read_classify_request(group_then_images, max_images=64).images) == 3
    assert read_classify_request(b"\x4b\x4c" + empty_images(2 * 65), max_images=64).unreadable.startswith(
        "request has more than 64 images")
    assert read_infer_request(b"\x3a\x00" * 9).unreadable.startswith("raw_input_contents has more than 8 entries")


@pytest.mark.parametrize("name", list(FLOODS))
def test_a_flood_is_refused_at_once_while_health_answers_within_a_second(server, name):
    method, wire, reason = FLOODS[name]
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 * MIB)]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        health_times: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                started = time.monotonic()
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                health_times.append(time.monotonic() - started)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as refused:
                    channel.unary_unary(method)(wire, timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert reason in refused.value.details()
        finally:
            stop.set()
            prober.join()
    assert health_times and max(health_times) < 1.0


def infer_with_id(request_id: str, images: int) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="resnet18_uint8", id=request_id)
    request.inputs.add(name="input", datatype="UINT8", shape=[images, 1, 1, 3])
    request.raw_input_contents.append(bytes(range(3)) * images)
    return request


class _Submits(logging.Handler):
    """The Submits the front-end sends its engine (the protocol's DEBUG record of each message it sends)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.submits: list = []

    def emit(self, record: logging.LogRecord) -> None:
        message = getattr(record, "engine_message", None)
        if type(message).__name__ == "Submit":
            self.submits.append(message)


@pytest.mark.slow
def test_a_long_infer_id_reaches_the_engine_and_the_log_cut_to_64_printable_characters(server):
    long_id = "line one\nforged line " + "x" * 200  # ids are at most 256 bytes (resnet_server.frontend.bounds)
    seen = _Submits()
    protocol_log = logging.getLogger("resnet_server.boundary.protocol")
    protocol_log.addHandler(seen)
    protocol_log.setLevel(logging.DEBUG)
    try:
        with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 * MIB),
                                                           ("grpc.max_receive_message_length", 64 * MIB)]) as channel:
            infer = channel.unary_unary(MODEL_INFER, request_serializer=oip.ModelInferRequest.SerializeToString,
                                        response_deserializer=oip.ModelInferResponse.FromString)
            response = infer(infer_with_id(long_id, 64), timeout=60)
    finally:
        protocol_log.removeHandler(seen)
        protocol_log.setLevel(logging.NOTSET)
    assert response.id == long_id and response.outputs[0].shape == [64, 1000]  # the caller's id, echoed whole
    entries = [entry for submit in seen.submits for entry in submit.entries]
    assert len(entries) == 64
    (submit,) = seen.submits  # one call, one id: sent once, not once an image
    assert submit.request_ids == [("line one?forged line " + "x" * 64)[:64]]


def test_an_infer_id_over_the_string_bound_is_refused_unread(server):
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 * MIB)]) as channel:
        infer = channel.unary_unary(MODEL_INFER, request_serializer=oip.ModelInferRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as refused:
            infer(infer_with_id("x" * (8 * MIB), 1), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "inference.ModelInferRequest.id is longer than 256 bytes"


def jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(buffer, format="JPEG", quality=10)
    return buffer.getvalue()


def with_marker_after_start(data: bytes) -> bytes:
    return data[:2] + b"\xff\x01" + data[2:]  # TEM, a standalone marker: libjpeg skips it, PIL gives up


def test_a_jpeg_pil_cannot_open_has_its_size_read_from_its_frame_header():
    bomb = with_marker_after_start(jpeg(3000, 2000))
    with pytest.raises(Exception):  # noqa: B017 - PIL's own refusal, whatever its type
        Image.open(io.BytesIO(bomb))
    assert declared_size(bomb) == (3000, 2000)
    for refuse in (lambda: check_header(bomb, 1_000_000),
                   lambda: defer_or_preprocess(EncodedImage(bomb), 1_000_000),
                   lambda: preprocess(EncodedImage(bomb), 1_000_000)):
        with pytest.raises(InvalidInput, match="3000x2000 = 6000000 pixels, over the limit of 1000000"):
            refuse()


def test_the_engines_decode_keeps_the_pixel_limit():
    small, bomb = jpeg(64, 48), with_marker_after_start(jpeg(3000, 2000))
    results = decode_batch([DeferredJpeg.of(data, 1_000_000) for data in (small, bomb)], torch.device("cpu"))
    assert results[0].shape == (3, 224, 224)
    assert isinstance(results[1], InvalidInput) and "over the limit of 1000000" in str(results[1])


@pytest.mark.parametrize("data, reason", [
    (b"\xff\xd8\xff\xda" + bytes(100), "no frame header (SOFn) before its data"),
    (b"\x89PNG\r\n\x1a\n" + bytes(100), "cannot decode PNG image (108 bytes): its header gives no size"),
], ids=["JPEG scan before any frame", "PNG without a header"])
def test_an_image_whose_header_gives_no_size_is_refused_undecoded(data, reason):
    with pytest.raises(InvalidInput, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_header(data, 40_000_000)


def test_a_frame_header_after_other_segments_and_fill_bytes_is_found():
    size = struct.pack(">HH", 600, 800)
    data = (b"\xff\xd8" + b"\xff\xe0\x00\x04ab" + b"\xff\xff\xd0" + b"\xff\xc2\x00\x0b\x08" + size + b"\x03\x01\x22"
            + b"\xff\xda")
    assert declared_size(data) == (800, 600)


def test_marker_jpegs_over_the_limit_are_refused_over_grpc_before_decoding(make_server):
    running = make_server(max_pixels=1_000_000)
    bomb = with_marker_after_start(jpeg(3000, 2000))
    request = pb.ClassifyRequest(images=[pb.Image(encoded=bomb)] * 16)
    with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary(CLASSIFY, request_serializer=pb.ClassifyRequest.SerializeToString)(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3000x2000 = 6000000 pixels, over the limit of 1000000" in refused.value.details()
    assert running.sample("resnet_images_total", device="cpu", code="INVALID_ARGUMENT") == 16


def test_calls_waiting_to_be_decoded_are_bounded_by_the_queue(make_server):
    running = make_server(preprocess_threads=1, max_queue=4, max_images_per_request=4, decode_on_device="false")
    png = encode(random_rgb(61, 1200, 1200), "PNG")  # a few tens of milliseconds to decode, one at a time

    async def burst():
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = pb_grpc.ClassifierStub(channel)
            request = pb.ClassifyRequest(images=[pb.Image(encoded=png)])
            calls = [stub.Classify(request, timeout=120) for _ in range(40)]
            answers = await asyncio.gather(*calls, return_exceptions=True)
        return [grpc.StatusCode.OK if isinstance(answer, pb.ClassifyResponse) else answer.code()
                for answer in answers]

    codes = asyncio.run(burst())
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20  # most refused at once, not queued to decode


def test_a_stream_whose_answers_are_not_read_stops_being_read(make_server):
    server = make_server(runner="free")  # answers at once: only the stream's window holds them back
    image = pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.UINT8, shape=[224, 224, 3], data=bytes(224 * 224 * 3)))
    request = pb.ClassifyRequest(images=[image], return_probabilities=True, return_logits=True)
    sent = 3000
    before = server.sample("resnet_requests_total", device="cpu", code="OK")

    async def send_and_never_read() -> int:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stream = pb_grpc.ClassifierStub(channel).ClassifyStream(timeout=120)
            written = 0

            async def write_all() -> None:
                nonlocal written
                for _ in range(sent):
                    await stream.write(request)
                    written += 1

            writer = asyncio.ensure_future(write_all())
            # Nothing is read: the server answers what fits its window and gRPC's buffers, then stops reading.
            last = -1
            while written != last and not writer.done():
                last = written
                await asyncio.sleep(2)
            writer.cancel()
            stream.cancel()
            return written

    written = asyncio.run(send_and_never_read())
    answered_unread = server.sample("resnet_requests_total", device="cpu", code="OK") - before
    # The window's 64 and what gRPC buffers of answers written and unread (a few megabytes), not all it was sent.
    assert written < sent / 2 and answered_unread < sent / 2
