"""Reading a request with its pixels left in place (server.wire) means what protobuf's own parse means, to the
byte: ClassifyRequest and the Open Inference Protocol's ModelInferRequest and RepositoryModelLoadRequest."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError

from resnet_client import Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_server.common.preprocess import EncodedImage, RawImage
from resnet_server.frontend.classify_request import image_input, read_classify_request
from resnet_server.frontend.oip_service import read_infer_request
from resnet_server.frontend.repository_service import MOST_FILES, read_load_request
from resnet_server.frontend.wire import FALLBACK_BYTES
from tests.helpers import encode, random_rgb

PIXELS = bytes(range(256)) * 588  # 150,528 bytes: a uint8 224x224x3 image


def raw(data: bytes = PIXELS, dtype=pb.RawTensor.UINT8, shape=(224, 224, 3)) -> pb.Image:
    return pb.Image(raw=pb.RawTensor(dtype=dtype, shape=shape, data=data))


def key(number: int, wire_type: int) -> bytes:
    return bytes([number << 3 | wire_type])


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def delimited(number: int, payload: bytes) -> bytes:
    return key(number, 2) + varint(len(payload)) + payload


def unknown_fields() -> bytes:
    """One unknown field of every wire type protobuf keeps: varint, fixed64, length-delimited, fixed32."""
    return key(15, 0) + varint(300) + key(14, 1) + bytes(8) + delimited(13, b"later") + key(12, 5) + bytes(4)


def serialized(request: pb.ClassifyRequest) -> bytes:
    return request.SerializeToString()


ONE_RAW = serialized(pb.ClassifyRequest(images=[raw()], top_k=1))
WIRE = {
    "one raw image": ONE_RAW,
    "no images": b"",
    "every field": serialized(pb.ClassifyRequest(
        images=[raw(), pb.Image(encoded=encode(random_rgb(1))), raw(bytes(3 * 224 * 224 * 4), pb.RawTensor.FLOAT32,
                                                                    (3, 224, 224))],
        temperature=2.5, top_k=3, return_probabilities=True, return_logits=True)),
    "zero temperature and top_k, set": serialized(pb.ClassifyRequest(images=[raw()], temperature=0.0, top_k=0)),
    "negative top_k (a ten-byte varint)": serialized(pb.ClassifyRequest(images=[raw()], top_k=-1)),
    "an image without data": serialized(pb.ClassifyRequest(images=[pb.Image()])),
    "a tensor without data": serialized(pb.ClassifyRequest(images=[raw(b"")])),
    "an unknown dtype": serialized(pb.ClassifyRequest(images=[raw(dtype=7)])),
    "fields in another order, images apart": (key(3, 0) + varint(2) + delimited(1, serialized(raw()))
                                               + key(2, 1) + bytes(7) + b"\x40" + delimited(1, serialized(raw()))),
    "unknown fields at every level": (unknown_fields() + delimited(1, unknown_fields() + delimited(
        2, unknown_fields() + key(1, 0) + b"\x01" + delimited(3, PIXELS) + delimited(2, varint(224) * 2 + b"\x03")))),
    "shape unpacked": delimited(1, delimited(2, key(1, 0) + b"\x01" + b"".join(
        key(2, 0) + varint(side) for side in (224, 224, 3)) + delimited(3, PIXELS))),
    "shape in two packed runs": delimited(1, delimited(2, key(1, 0) + b"\x01" + delimited(2, varint(224) * 2)
                                                        + delimited(3, PIXELS) + delimited(2, b"\x03"))),
    "data twice (the last one counts)": delimited(1, delimited(2, key(1, 0) + b"\x01" + delimited(3, b"first")
                                                               + delimited(2, b"\x01\x01\x03") + delimited(3, b"abc"))),
    # What the reader leaves to protobuf: the oneof set twice (the last wins), the tensor twice (merged), a group.
    "encoded, then raw": delimited(1, delimited(1, b"jpeg") + delimited(2, serialized(raw().raw))),
    "raw twice (merged)": delimited(1, delimited(2, key(1, 0) + b"\x01") + delimited(2, delimited(3, PIXELS)
                                                                                     + delimited(2, b"\x01\x01\x03"))),
    "a group": key(9, 3) + key(9, 4) + delimited(1, serialized(raw())),
}


def as_bytes(image):
    """An image with its data as bytes, to compare a memoryview's contents with protobuf's copy."""
    return image._replace(data=bytes(image.data))


@pytest.mark.parametrize("name", list(WIRE))
def test_the_reader_reads_what_protobuf_reads(name):
    wire = WIRE[name]
    expected = pb.ClassifyRequest.FromString(wire)
    read = read_classify_request(wire, max_images=64)
    assert [as_bytes(image) for image in read.images] == [as_bytes(image_input(image)) for image in expected.images]
    for field in ("temperature", "top_k"):
        assert read.fields.HasField(field) == expected.HasField(field)
        assert getattr(read.fields, field) == getattr(expected, field)
    assert read.fields.return_probabilities == expected.return_probabilities
    assert read.fields.return_logits == expected.return_logits


def test_a_raw_image_stays_in_the_request_bytes():
    (image,) = read_classify_request(ONE_RAW, max_images=64).images
    assert isinstance(image, RawImage) and (image.dtype, image.shape) == ("uint8", (224, 224, 3))
    assert isinstance(image.data, memoryview) and image.data.obj is ONE_RAW  # no copy made
    assert image.data == PIXELS
    one_encoded = serialized(pb.ClassifyRequest(images=[pb.Image(encoded=b"jpeg")]))
    (encoded,) = read_classify_request(one_encoded, max_images=64).images
    assert encoded == EncodedImage(b"jpeg") and type(encoded.data) is bytes  # decoders take bytes


@pytest.mark.parametrize("wire", [ONE_RAW[:-1], ONE_RAW[:3], b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                  b"\x00\x01", delimited(1, b"\x00\x01")],
                         ids=["truncated data", "truncated length", "overlong varint", "field 0", "field 0 inside"])
def test_bytes_that_are_no_request_are_unreadable_as_protobuf_finds_them(wire):
    with pytest.raises(DecodeError) as caught:
        pb.ClassifyRequest.FromString(wire)
    unreadable = read_classify_request(wire, max_images=64).unreadable
    assert unreadable == f"the request is not a resnet.v1.ClassifyRequest: {caught.value}"


def test_a_request_that_is_no_protobuf_is_invalid_argument_and_the_server_keeps_serving(server):
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/resnet.v1.Classifier/Classify")(ONE_RAW[:-1], timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == ("the request is not a resnet.v1.ClassifyRequest: Error parsing message with "
                                      "type 'resnet.v1.ClassifyRequest': Wire format was corrupt")
    with Client(server.target, timeout=60) as client:
        (result,) = client.classify([random_rgb(2)])
    assert len(result.top_k) == 5


def infer_request(*contents: bytes) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="resnet18", id="seven", raw_input_contents=contents)
    request.inputs.add(name="input", datatype="UINT8", shape=[len(contents), 224, 224, 3])
    request.outputs.add(name="probabilities")
    request.parameters["top_k"].int64_param = 3
    return request


INFER_WIRE = {
    "one tensor": serialized(infer_request(PIXELS)),
    "two tensors, unknown fields between": (unknown_fields() + serialized(infer_request(PIXELS, b"second"))
                                            + unknown_fields()),
    "no raw contents": serialized(infer_request()),
    "a group (left to protobuf)": key(9, 3) + key(9, 4) + serialized(infer_request(PIXELS)),
}


@pytest.mark.parametrize("name", list(INFER_WIRE))
def test_the_infer_reader_reads_what_protobuf_reads(name):
    wire = INFER_WIRE[name]
    expected = oip.ModelInferRequest.FromString(wire)
    read = read_infer_request(wire)
    assert [bytes(contents) for contents in read.raw_input_contents] == list(expected.raw_input_contents)
    del expected.raw_input_contents[:]
    assert read.message == expected and read.unreadable is None


def test_infer_raw_contents_stay_in_the_request_bytes():
    wire = serialized(infer_request(PIXELS))
    (contents,) = read_infer_request(wire).raw_input_contents
    assert isinstance(contents, memoryview) and contents.obj is wire and contents == PIXELS


def test_an_infer_request_that_is_no_protobuf_is_invalid_argument_alone_and_in_a_stream(server):
    wire = serialized(infer_request(PIXELS))[:-1]
    with pytest.raises(DecodeError) as caught:
        oip.ModelInferRequest.FromString(wire)
    expected = f"the request is not an inference.ModelInferRequest: {caught.value}"
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(wire, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details() == expected
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=oip.ModelStreamInferResponse.FromString)
        good = infer_request(bytes(224 * 224 * 3))
        answers = list(stream(iter([wire, serialized(good)]), timeout=60))
        assert [answer.error_message for answer in answers] == [f"[INVALID_ARGUMENT] {expected}", ""]
        assert answers[1].infer_response.id == "seven" and answers[1].infer_response.outputs[0].shape == [1, 1000]
        assert oip_grpc.GRPCInferenceServiceStub(channel).ServerLive(oip.ServerLiveRequest(), timeout=30).live


WEIGHTS = bytes(range(256)) * 4096  # a file of weights tritonclient's load_model(files=...) sends


def load_request(**files: bytes) -> oip.RepositoryModelLoadRequest:
    parameter = oip.ModelRepositoryParameter
    return oip.RepositoryModelLoadRequest(model_name="resnet18", parameters={
        "config": parameter(string_param="{}"), **{f"file:{name}": parameter(bytes_param=data)
                                                    for name, data in files.items()}})


LOAD_WIRE = {
    "a file and a config": serialized(load_request(**{"1/model.pt": WEIGHTS})),
    "no file": serialized(load_request()),
    "two files, unknown fields between": (unknown_fields() + serialized(load_request(a=b"first", b=WEIGHTS))
                                          + unknown_fields()),
    "an empty file": serialized(load_request(empty=b"")),
    "a group (left to protobuf)": key(9, 3) + key(9, 4) + serialized(load_request(**{"1/model.pt": b"weights"})),
}


@pytest.mark.parametrize("name", list(LOAD_WIRE))
def test_the_load_reader_reads_what_protobuf_reads(name):
    wire = LOAD_WIRE[name]
    expected = oip.RepositoryModelLoadRequest.FromString(wire)
    read = read_load_request(wire)
    files = {key: value.bytes_param for key, value in expected.parameters.items() if key.startswith("file:")}
    assert {key: bytes(data) for key, data in read.files} == files
    for key in files:
        del expected.parameters[key]
    assert read.message == expected and read.unreadable is None


def test_a_sent_file_stays_in_the_request_bytes():
    wire = serialized(load_request(**{"1/model.pt": WEIGHTS}))
    ((name, data),) = read_load_request(wire).files
    assert name == "file:1/model.pt" and isinstance(data, memoryview) and data.obj is wire and data == WEIGHTS


def test_a_load_request_that_is_no_protobuf_is_unreadable_as_protobuf_finds_it():
    wire = serialized(load_request(**{"1/model.pt": b"weights"}))[:-1]
    with pytest.raises(DecodeError) as caught:
        oip.RepositoryModelLoadRequest.FromString(wire)
    read = read_load_request(wire)
    assert read.files == []
    assert read.unreadable == f"the request is not an inference.RepositoryModelLoadRequest: {caught.value}"


def test_a_flood_of_files_is_not_walked_past_a_few():
    """Tiny file entries, millions in a message gRPC accepts, would hold the event loop for seconds: the walk stops
    after MOST_FILES and a request that large is refused unread; a small one is protobuf's to read."""
    many = {f"{index}/model.pt": b"w" for index in range(MOST_FILES + 1)}
    read = read_load_request(serialized(load_request(**many)))
    assert len(read.files) == MOST_FILES + 1 and read.unreadable is None  # protobuf read it: under 1 MiB
    flood = serialized(load_request(**{str(index): b"" for index in range(120_000)}))
    assert len(flood) > FALLBACK_BYTES
    refused = read_load_request(flood)
    assert refused.files == [] and refused.unreadable == (
        "the request is not an inference.RepositoryModelLoadRequest as this server reads one (more than "
        f"{MOST_FILES} files, in {len(flood)} bytes)")
