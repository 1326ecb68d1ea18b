"""The Open Inference Protocol, driven by the real tritonclient[grpc] package.

tritonclient 2.41 sends parameters as bool, int or string (newer releases add float but need
protobuf < 7, which grpcio 1.85 cannot use), so double_param is sent through our own stub.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
from tritonclient.utils import InferenceServerException

from resnet_client import Client
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from tests.helpers import encode, random_rgb

IMAGES = [random_rgb(500 + i, 240, 300) for i in range(3)]
JPEGS = [encode(image) for image in IMAGES]


@pytest.fixture(scope="module")
def triton(server):
    client = tc.InferenceServerClient(server.target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def ours(server):
    with Client(server.target, timeout=60) as client:
        yield client


def bytes_input(images: list[bytes]) -> tc.InferInput:
    tensor = tc.InferInput("input", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    return tensor


def array_input(array: np.ndarray, datatype: str) -> tc.InferInput:
    tensor = tc.InferInput("input", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_live_ready_and_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("resnet18") and triton.is_model_ready("resnet18", "1")
    server = triton.get_server_metadata(as_json=True)
    assert server["name"] == "resnet-grpc" and "model_configuration" in server["extensions"]
    model = triton.get_model_metadata("resnet18", as_json=True)
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "3", "224", "224"]}]
    assert [output["name"] for output in model["outputs"]] == [
        "probabilities", "top_k_indices", "top_k_probabilities", "top_k_labels"]


def test_model_config(triton, weights_file):
    config = triton.get_model_config("resnet18", as_json=True)["config"]
    assert config["name"] == "resnet18" and config["max_batch_size"] == 64
    assert config["input"][0]["dims"] == ["3", "224", "224"] and config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["parameters"] == {"default_temperature": {"string_value": "1"},
                                    "wait_for_callers_ms": {"string_value": "0"},
                                    "weights_sha256": {"string_value": sha256(weights_file[0])}}


def test_model_config_reports_the_served_settings(make_server, weights_file):
    running = make_server(max_batch_size=4, max_batch_delay_ms=2.5, wait_for_callers_ms=30.0, temperature=0.5,
                          max_images_per_request=16)
    with tc.InferenceServerClient(running.target) as triton:
        config = triton.get_model_config("resnet18", as_json=True)["config"]
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"] == {"preferred_batch_size": [4], "max_queue_delay_microseconds": "2500"}
    assert config["parameters"] == {"default_temperature": {"string_value": "0.5"},
                                    "wait_for_callers_ms": {"string_value": "30"},
                                    "weights_sha256": {"string_value": sha256(weights_file[0])}}


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_uint8_name_declares_raw_pixels_and_serves_the_same_model(triton):
    """resnet18_uint8: the same model, its metadata and config declaring the UINT8 [N, H, W, 3] input (for tools
    that build requests from the declaration); answers equal the resnet18 name's, and name themselves."""
    assert triton.is_model_ready("resnet18_uint8") and triton.is_model_ready("resnet18_uint8", "1")
    model = triton.get_model_metadata("resnet18_uint8", as_json=True)
    assert model["name"] == "resnet18_uint8" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "UINT8", "shape": ["-1", "-1", "-1", "3"]}]
    assert model["outputs"] == triton.get_model_metadata("resnet18", as_json=True)["outputs"]
    config = triton.get_model_config("resnet18_uint8", as_json=True)["config"]
    assert config["name"] == "resnet18_uint8"
    assert config["input"] == [{"name": "input", "data_type": "TYPE_UINT8", "format": "FORMAT_NHWC",
                                "dims": ["-1", "-1", "3"]}]
    fp32_config = triton.get_model_config("resnet18", as_json=True)["config"]
    assert {key: value for key, value in config.items() if key not in ("name", "input")} == {
        key: value for key, value in fp32_config.items() if key not in ("name", "input")}
    tensor = array_input(np.stack(IMAGES), "UINT8")
    by_uint8_name = triton.infer("resnet18_uint8", [tensor], parameters={"temperature": "1.5"})
    by_first_name = triton.infer("resnet18", [tensor], parameters={"temperature": "1.5"})
    assert by_uint8_name.get_response().model_name == "resnet18_uint8"
    np.testing.assert_allclose(by_uint8_name.as_numpy("probabilities"), by_first_name.as_numpy("probabilities"),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("call", ["is_model_ready", "get_model_metadata", "get_model_config"])
def test_unknown_model_or_version_is_not_found(triton, call):
    for name, version in (("resnet50", ""), ("resnet18", "2")):
        if call == "is_model_ready":
            with pytest.raises(InferenceServerException) as caught:
                triton.is_model_ready(name, version)
        else:
            with pytest.raises(InferenceServerException) as caught:
                getattr(triton, call)(name, version)
        assert caught.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("kind", ["BYTES", "UINT8", "FP32"])
def test_infer_each_input_kind_matches_our_api(triton, ours, reference, kind):
    if kind == "BYTES":
        tensor, ours_images = bytes_input(JPEGS), JPEGS
    elif kind == "UINT8":
        tensor, ours_images = array_input(np.stack(IMAGES), "UINT8"), IMAGES
    else:
        normalised = np.stack([reference.input_from_array(image).numpy() for image in IMAGES])
        tensor, ours_images = array_input(normalised, "FP32"), list(normalised)
    result = triton.infer("resnet18", [tensor], parameters={"temperature": "1.5", "top_k": 3})
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (3, 1000) and probabilities.dtype == np.float32
    expected = ours.classify(ours_images, temperature=1.5, top_k=3, full=True)
    np.testing.assert_allclose(probabilities, [e.probabilities for e in expected], atol=1e-6, rtol=0)
    assert result.as_numpy("top_k_indices").tolist() == [[s.index for s in e.top_k] for e in expected]
    np.testing.assert_allclose(result.as_numpy("top_k_probabilities"),
                               [[s.probability for s in e.top_k] for e in expected], atol=1e-6)
    assert result.as_numpy("top_k_labels").astype(str).tolist() == [[s.label for s in e.top_k] for e in expected]


def test_typed_contents_are_accepted(server, ours):
    request = oip.ModelInferRequest(model_name="resnet18")
    tensor = request.inputs.add(name="input", datatype="UINT8", shape=[1, *IMAGES[0].shape])
    tensor.contents.uint_contents.extend(IMAGES[0].reshape(-1).tolist())
    request.parameters["temperature"].double_param = 0.5  # Triton's double_param
    encoded = oip.ModelInferRequest(model_name="resnet18")
    encoded.inputs.add(name="input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(JPEGS[0])
    with grpc.insecure_channel(server.target) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        typed = stub.ModelInfer(request, timeout=60)
        typed_bytes = stub.ModelInfer(encoded, timeout=60)
    (expected,) = ours.classify([IMAGES[0]], temperature=0.5, full=True)
    got = np.frombuffer(typed.raw_output_contents[0], dtype="<f4")
    np.testing.assert_allclose(got, expected.probabilities, atol=1e-6, rtol=0)
    (expected_jpeg,) = ours.classify([JPEGS[0]], full=True)
    np.testing.assert_allclose(np.frombuffer(typed_bytes.raw_output_contents[0], dtype="<f4"),
                               expected_jpeg.probabilities, atol=1e-6, rtol=0)


def test_output_selection_and_temperature(triton):
    only_labels = triton.infer("resnet18", [bytes_input(JPEGS[:1])], parameters={"top_k": 2},
                               outputs=[tc.InferRequestedOutput("top_k_labels")])
    response = only_labels.get_response()
    assert [output.name for output in response.outputs] == ["top_k_labels"]
    assert only_labels.as_numpy("probabilities") is None and only_labels.as_numpy("top_k_labels").shape == (1, 2)
    plain = triton.infer("resnet18", [bytes_input(JPEGS[:1])])
    assert [output.name for output in plain.get_response().outputs] == ["probabilities"]
    cold = triton.infer("resnet18", [bytes_input(JPEGS[:1])], parameters={"temperature": "0.2"})
    hot = triton.infer("resnet18", [bytes_input(JPEGS[:1])], parameters={"temperature": "5"})
    assert cold.as_numpy("probabilities").max() > plain.as_numpy("probabilities").max()
    assert hot.as_numpy("probabilities").max() < plain.as_numpy("probabilities").max()


def test_async_infer(server, ours):
    async def run():
        client = tc_aio.InferenceServerClient(server.target)
        try:
            return await asyncio.gather(*(client.infer("resnet18", [bytes_input([jpeg])]) for jpeg in JPEGS))
        finally:
            await client.close()

    results = asyncio.run(run())
    expected = ours.classify(JPEGS, full=True)
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(result.as_numpy("probabilities")[0], want.probabilities, atol=1e-6, rtol=0)


def test_streaming_infer_answers_each_request_and_reports_errors_in_stream(triton, ours):
    answers: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        triton.async_stream_infer("resnet18", [bytes_input(JPEGS[:1])], request_id="a")
        triton.async_stream_infer("resnet18", [bytes_input([b"junk"])], request_id="b")
        triton.async_stream_infer("resnet18", [bytes_input(JPEGS[1:2])], request_id="c")
        received = [answers.get(timeout=60) for _ in range(3)]
    finally:
        triton.stop_stream()
    (first, first_error), (_, second_error), (third, third_error) = received
    assert first_error is None and third_error is None
    assert first.get_response().id == "a" and third.get_response().id == "c"
    assert "INVALID_ARGUMENT" in str(second_error) and "cannot decode" in str(second_error)
    expected = ours.classify(JPEGS[:2], full=True)
    np.testing.assert_allclose(first.as_numpy("probabilities")[0], expected[0].probabilities, atol=1e-6)
    np.testing.assert_allclose(third.as_numpy("probabilities")[0], expected[1].probabilities, atol=1e-6)


BAD = {
    "wrong datatype": lambda: ([array_input(np.zeros((1, 8, 8, 3), np.int32), "INT32")], {}),
    "wrong shape": lambda: ([array_input(np.zeros((1, 3, 32, 32), np.float32), "FP32")], {}),
    "wrong uint8 shape": lambda: ([array_input(np.zeros((1, 8, 8), np.uint8), "UINT8")], {}),
    "missing input": lambda: ([tc.InferInput("pixels", [1], "BYTES").set_data_from_numpy(
        np.array([JPEGS[0]], dtype=np.object_))], {}),
    "bad temperature": lambda: ([bytes_input(JPEGS[:1])], {"temperature": "hot"}),
    "negative temperature": lambda: ([bytes_input(JPEGS[:1])], {"temperature": -1}),
    "bad top_k": lambda: ([bytes_input(JPEGS[:1])], {"top_k": 0}),
    "undecodable image": lambda: ([bytes_input([b"junk"])], {}),
}


@pytest.mark.parametrize("name", list(BAD))
def test_errors_are_invalid_argument(triton, name):
    inputs, parameters = BAD[name]()
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("resnet18", inputs, parameters=parameters)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value.message()
    assert triton.infer("resnet18", [bytes_input(JPEGS[:1])]).as_numpy("probabilities").shape == (1, 1000)


def test_unknown_output_and_model_in_infer(triton):
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("resnet18", [bytes_input(JPEGS[:1])], outputs=[tc.InferRequestedOutput("embedding")])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("resnet50", [bytes_input(JPEGS[:1])])
    assert caught.value.status() == "StatusCode.NOT_FOUND"
