"""The HTTP front-end: the Open Inference Protocol's REST API driven by the real tritonclient.http (JSON and
binary tensors, its sync and aio clients), the project's own API as JSON driven by curl, against the shared
server, which serves gRPC and HTTP from one front-end; answers compared with gRPC's and torchvision's."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc_grpc
import tritonclient.http as tc
import tritonclient.http.aio as tc_aio
from tritonclient.utils import InferenceServerException

from tests.helpers import encode, random_rgb

IMAGES = [random_rgb(700 + i, 240, 300) for i in range(3)]
JPEGS = [encode(image) for image in IMAGES]


@pytest.fixture(scope="module")
def triton(server):
    client = tc.InferenceServerClient(server.http_target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def triton_grpc(server):
    client = tc_grpc.InferenceServerClient(server.target)
    yield client
    client.close()


def bytes_input(images: list[bytes], binary: bool = True) -> tc.InferInput:
    tensor = tc.InferInput("input", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=binary)
    return tensor


def array_input(array: np.ndarray, datatype: str, binary: bool = True) -> tc.InferInput:
    tensor = tc.InferInput("input", list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def grpc_probabilities(client, name: str, array: np.ndarray, datatype: str, temperature: str = "1") -> np.ndarray:
    tensor = tc_grpc.InferInput("input", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return client.infer(name, [tensor], parameters={"temperature": temperature}).as_numpy("probabilities")


def request(target: str, path: str, body: bytes | None = None, headers: dict | None = None,
            method: str | None = None) -> tuple[int, dict, bytes]:
    """One HTTP call with the standard library: its status, headers and body (an error status too)."""
    call = urllib.request.Request(f"http://{target}{path}", data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(call, timeout=60) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_health_metadata_and_config_as_tritonclient_reads_them(triton, triton_grpc):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("resnet18") and triton.is_model_ready("resnet18_uint8", "1")
    server = triton.get_server_metadata()
    assert server["name"] == "resnet-grpc" and "binary_tensor_data" in server["extensions"]
    model = triton.get_model_metadata("resnet18")
    assert model["versions"] == ["1"] and model["platform"] == "pytorch_libtorch"
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    config = triton.get_model_config("resnet18_uint8")
    assert config["name"] == "resnet18_uint8" and config["input"][0]["dims"] == [-1, -1, 3]
    grpc_config = triton_grpc.get_model_config("resnet18_uint8", as_json=True)["config"]
    assert config["max_batch_size"] == grpc_config["max_batch_size"]
    assert config["parameters"] == grpc_config["parameters"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("kind", ["BYTES", "UINT8", "FP32"])
def test_each_input_form_answers_as_grpc_does(triton, triton_grpc, reference, kind, binary):
    if kind == "BYTES":
        if not binary:
            pytest.skip("encoded images are not text: JSON carries BYTES as strings")
        array = np.array(JPEGS, dtype=np.object_)
        tensor = bytes_input(JPEGS)
        expected = np.stack([reference.probabilities(reference.input_from_bytes(jpeg), 1.5) for jpeg in JPEGS])
    elif kind == "UINT8":
        array = np.stack(IMAGES)
        tensor = array_input(array, "UINT8", binary)
        expected = np.stack([reference.probabilities(reference.input_from_array(image), 1.5) for image in IMAGES])
    else:
        array = np.stack([reference.input_from_array(image).numpy() for image in IMAGES])
        tensor = array_input(array, "FP32", binary)
        expected = np.stack([reference.probabilities(model_input, 1.5) for model_input in map(
            __import__("torch").from_numpy, array)])
    outputs = [tc.InferRequestedOutput(name, binary_data=binary) for name in
               ("probabilities", "top_k_indices", "top_k_probabilities", "top_k_labels")]
    result = triton.infer("resnet18", [tensor], outputs=outputs, parameters={"temperature": 1.5, "top_k": 3})
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (3, 1000) and probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, grpc_probabilities(triton_grpc, "resnet18", array, kind, "1.5"),
                               atol=1e-6, rtol=0)
    np.testing.assert_allclose(probabilities, expected, atol=1e-4, rtol=0)
    indices = result.as_numpy("top_k_indices")
    assert indices.shape == (3, 3)
    assert indices.tolist() == np.argsort(-probabilities, axis=1)[:, :3].tolist()
    np.testing.assert_allclose(result.as_numpy("top_k_probabilities"),
                               np.take_along_axis(probabilities, indices, axis=1), atol=1e-6)
    assert result.as_numpy("top_k_labels").shape == (3, 3)
    assert result.get_response()["model_version"] == "1"


def test_the_aio_client_and_the_default_outputs(server, reference):
    async def infer() -> tuple[np.ndarray, dict]:
        async with tc_aio.InferenceServerClient(server.http_target) as client:
            assert await client.is_server_ready()
            result = await client.infer("resnet18_uint8", [array_input(np.stack(IMAGES[:2]), "UINT8")],
                                        request_id="aio-1")
            return result.as_numpy("probabilities"), result.get_response()
    probabilities, response = asyncio.run(infer())
    assert response["id"] == "aio-1" and response["model_name"] == "resnet18_uint8"
    assert [output["name"] for output in response["outputs"]] == ["probabilities"]
    np.testing.assert_allclose(probabilities, np.stack([
        reference.probabilities(reference.input_from_array(image)) for image in IMAGES[:2]]), atol=1e-4, rtol=0)


def test_nested_json_data_and_a_json_answer_by_hand(server, reference):
    """JSON as the spec gives it: ``data`` nested as the shape, the answer's outputs as JSON numbers."""
    image = IMAGES[0][:32, :48]
    body = {"id": "by-hand", "inputs": [{"name": "input", "datatype": "UINT8", "shape": [1, 32, 48, 3],
                                         "data": [image.tolist()]}],
            "parameters": {"top_k": 2}, "outputs": [{"name": "probabilities"}, {"name": "top_k_labels"}]}
    status, headers, answer = request(server.http_target, "/v2/models/resnet18/infer", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    parsed = json.loads(answer)
    assert parsed["id"] == "by-hand" and parsed["model_name"] == "resnet18" and parsed["model_version"] == "1"
    probabilities, labels = parsed["outputs"]
    assert probabilities["shape"] == [1, 1000] and probabilities["datatype"] == "FP32"
    np.testing.assert_allclose(probabilities["data"], reference.probabilities(reference.input_from_array(image)),
                               atol=1e-4)
    assert labels["datatype"] == "BYTES" and labels["shape"] == [1, 2] and all(
        isinstance(label, str) and label for label in labels["data"])


def test_classify_in_json_with_curl(server, reference, tmp_path):
    """The README's curl line: a ClassifyRequest in protobuf's JSON mapping, the image in base64."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = tmp_path / "request.json"
    body.write_text(json.dumps({"images": [{"encoded": base64.b64encode(JPEGS[1]).decode()}], "top_k": 3,
                                "temperature": 2.0, "return_probabilities": True}))
    done = subprocess.run(["curl", "-sS", "--fail-with-body", "-H", "Content-Type: application/json",
                           "--data-binary", f"@{body}", f"http://{server.http_target}/v1/classify"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads(done.stdout)["results"][0]
    expected = reference.probabilities(reference.input_from_bytes(JPEGS[1]), 2.0)
    assert [score["index"] for score in result["topK"]] == np.argsort(-expected)[:3].tolist()
    np.testing.assert_allclose(result["probabilities"], expected, atol=1e-4)
    assert result["temperature"] == 2.0


def test_the_project_api_model_info(server):
    status, _, answer = request(server.http_target, "/v1/model")
    info = json.loads(answer)
    assert status == 200 and info["name"] == "resnet18" and info["devices"] == ["cpu"]


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/v2/models/resnet50/infer", b'{"inputs": []}', 404, "unknown model 'resnet50'"),
    ("/v2/models/resnet18/versions/7/infer", b'{"inputs": []}', 404, "version '7' of resnet18 is not served"),
    ("/v2/models/resnet18/infer", b"{not json", 400, "not an inference request"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "datatype": "INT8", "shape": [1], "data": [1]}]}',
     400, "FP32, UINT8 or BYTES"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "datatype": "UINT8", "shape": [1, 2, 2, 3], '
     b'"data": [1, 2, 3]}]}', 400, "needs 12 values, got 3"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "datatype": "UINT8", "shape": [1, 1, 1, 3], '
     b'"data": [1, 2, 300]}]}', 400, "whole numbers from 0 to 255"),
    ("/v2/models/resnet18/infer", b'{"inputs": [' + b",".join([b"{}"] * 300) + b"]}", 400, "objects"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "datatype": "UINT8", "shape": [' +
     b",".join([b"1"] * 200) + b'], "data": [1]}]}', 400, "a shape is longer than"),
    ("/v2/models/resnet18/infer", b"[" * 100_000 + b"]" * 100_000, 400, "not an inference request"),
    ("/v2/models/resnet18/infer", b'{"inputs": [{"name": "input", "datatype": "UINT8", "shape": [1], "data": ' +
     b"[" * 100_000 + b"]" * 100_000 + b"}]}", 400, "nests too deep"),
    ("/v2/models/resnet18/ready", None, 200, ""),
    ("/v2/models/resnet18/nothing", None, 404, "Not Found"),
    ("/v1/classify", b'{"images": [{"encoded": "not base64!"}]}', 400, "not a ClassifyRequest"),
    ("/v1/classify", b'{"images": [' + b",".join([b'{"encoded": ""}'] * 65) + b"]}", 400,
     "images (--max-images-per-request) holds more than 64 entries"),
])
def test_bad_requests_get_the_status_a_client_expects(server, path, body, status, says):
    answered, headers, text = request(server.http_target, path, body, method="POST" if body is not None else "GET")
    assert answered == status, text
    if says:
        assert headers["Content-Type"].startswith("application/json")
        assert says in json.loads(text)["error"]
    assert server.run(asyncio.sleep(0, result=True))  # the server's loop still runs


def test_binary_tensors_by_hand_and_a_header_length_past_the_body(server):
    image = IMAGES[2][:16, :16]
    header = json.dumps({"inputs": [{"name": "input", "datatype": "UINT8", "shape": [1, 16, 16, 3],
                                     "parameters": {"binary_data_size": image.nbytes}}],
                         "outputs": [{"name": "top_k_indices", "parameters": {"binary_data": True}}]}).encode()
    status, headers, answer = request(server.http_target, "/v2/models/resnet18/infer", header + image.tobytes(),
                                      {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200
    length = int(headers["Inference-Header-Content-Length"])
    described = json.loads(answer[:length])["outputs"][0]
    assert described["parameters"] == {"binary_data_size": 5 * 8} and described["shape"] == [1, 5]
    assert np.frombuffer(answer[length:], "<i8").shape == (5,)
    status, _, text = request(server.http_target, "/v2/models/resnet18/infer", header + image.tobytes(),
                              {"Inference-Header-Content-Length": str(len(header) + len(image.tobytes()) + 1)})
    assert status == 400 and "Inference-Header-Content-Length" in json.loads(text)["error"]
    status, _, text = request(server.http_target, "/v2/models/resnet18/infer", header + image.tobytes()[:-1],
                              {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "binary_data_size" in json.loads(text)["error"]


def test_an_invalid_image_names_itself(triton):
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("resnet18", [bytes_input([JPEGS[0], b"not an image"])])
    assert caught.value.status() == "400" and caught.value.message().startswith("images[1]: cannot decode image")


def test_the_request_metrics_say_which_protocol(server, triton):
    before = server.sample("resnet_requests_total", device="cpu", code="OK", protocol="http")
    grpc_before = server.sample("resnet_requests_total", device="cpu", code="OK", protocol="grpc")
    triton.infer("resnet18", [bytes_input(JPEGS[:1])])
    assert server.sample("resnet_requests_total", device="cpu", code="OK", protocol="http") == before + 1
    assert server.sample("resnet_requests_total", device="cpu", code="OK", protocol="grpc") == grpc_before
    assert server.sample("resnet_request_duration_seconds_count", device="cpu", protocol="http") >= before + 1


def test_statistics_count_http_calls(triton):
    before = triton.get_inference_statistics("resnet18")["model_stats"][0]["inference_count"]
    triton.infer("resnet18", [bytes_input(JPEGS[:2])])
    stats = triton.get_inference_statistics("resnet18")["model_stats"][0]
    assert stats["inference_count"] == before + 2 and isinstance(stats["inference_count"], int)


def test_extensions_refused_as_on_grpc(triton):
    """The model repository and shared memory are off on this server: 403, as gRPC's PERMISSION_DENIED."""
    with pytest.raises(InferenceServerException) as caught:
        triton.get_model_repository_index()
    assert caught.value.status() == "403" and "--model-control explicit" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        triton.register_system_shared_memory("region", "/resnet-test", 64)
    assert caught.value.status() == "403" and "--allow-client-shm" in caught.value.message()
    assert triton.get_trace_settings() == {"trace_level": ["OFF"]}
