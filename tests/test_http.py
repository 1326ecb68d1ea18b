"""The HTTP front-end: the Open Inference Protocol's REST API driven by the real tritonclient.http (JSON and
binary tensors, its sync and aio clients), the project's own API as JSON driven by curl, against the shared
server, which serves gRPC and HTTP from one front-end; answers compared with gRPC's and torchvision's."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc_grpc
import tritonclient.http as tc
import tritonclient.http.aio as tc_aio
from tritonclient.utils import InferenceServerException

from tests.certs import Authority
from tests.helpers import (
    IN_CI,
    ROOT,
    encode,
    free_port,
    load_script,
    needs_perf_analyzer,
    random_rgb,
    scraped_value,
    wait_for,
)
from tests.server_process import Workers

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


def readme_curl_line(path: str) -> str:
    """The README's curl line that calls ``path``."""
    readme = (ROOT / "README.md").read_text().splitlines()
    (line,) = [line for line in readme if line.startswith(f"curl -s localhost:8080{path}")]
    return line.split("  #")[0]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readmes_curl_line_classifies_in_json(server, reference):
    """The README's curl line as it is written (but the port): a ClassifyRequest in protobuf's JSON mapping, the
    image in base64."""
    line = readme_curl_line("/v1/classify").replace("localhost:8080", server.http_target)
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    (result,) = json.loads(done.stdout)["results"]
    image = (ROOT / "docs/samples/gradient.jpg").read_bytes()
    expected = reference.probabilities(reference.input_from_bytes(image))
    assert [score["index"] for score in result["topK"]] == np.argsort(-expected)[:3].tolist()
    np.testing.assert_allclose([score["probability"] for score in result["topK"]], np.sort(expected)[::-1][:3],
                               atol=1e-4)
    metadata = subprocess.run(["bash", "-c", readme_curl_line("/v2/models/resnet18").replace(
        "localhost:8080", server.http_target)], capture_output=True, text=True, timeout=60)
    assert json.loads(metadata.stdout)["name"] == "resnet18"


def test_classify_in_json_with_probabilities_and_a_temperature(server, reference):
    body = json.dumps({"images": [{"encoded": base64.b64encode(JPEGS[1]).decode()}], "top_k": 3,
                       "temperature": 2.0, "return_probabilities": True}).encode()
    status, _, answer = request(server.http_target, "/v1/classify", body)
    assert status == 200
    (result,) = json.loads(answer)["results"]
    expected = reference.probabilities(reference.input_from_bytes(JPEGS[1]), 2.0)
    np.testing.assert_allclose(result["probabilities"], expected, atol=1e-4)
    assert result["temperature"] == 2.0 and len(result["topK"]) == 3


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


@pytest.mark.slow
@needs_perf_analyzer
def test_perf_analyzer_over_http(server):
    """Triton's load generator over HTTP (binary tensors, the uint8 model, 16 in flight): every request answered."""
    figures = load_script("perf_analyzer").run(server.http_target, 16, window_requests=32, first_windows=True,
                                               input_kind="uint8", protocol="http", timeout=300)
    assert figures["requests"] >= 32 and figures["successes"] >= figures["requests"]


def test_tokens_tls_and_the_open_health_paths(make_server, tmp_path):
    """HTTPS with the gRPC port's certificate; a bearer token on every route but the health probes'."""
    ca = Authority(tmp_path, "http-ca")
    cert, key = ca.issue("server", "localhost", server=True)
    tokens = tmp_path / "tokens"
    tokens.write_text("http-secret\n")
    running = make_server(http_port=free_port(), tls_cert=cert, tls_key=key, auth_token_file=str(tokens))
    target = f"localhost:{running.app.http.port}"
    context = ssl.create_default_context(cafile=ca.cert_path)
    with tc.InferenceServerClient(target, ssl=True, ssl_context_factory=lambda: context) as client:
        assert client.is_server_live() and client.is_server_ready()  # open without a token
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_metadata("resnet18")
        assert caught.value.status() == "401" and "bearer token" in caught.value.message()
        wrong = {"Authorization": "Bearer not-it"}
        with pytest.raises(InferenceServerException) as caught:
            client.infer("resnet18", [bytes_input(JPEGS[:1])], headers=wrong)
        assert caught.value.status() == "401"
        right = {"Authorization": "Bearer http-secret"}
        result = client.infer("resnet18", [bytes_input(JPEGS[:1])], headers=right)
        assert result.as_numpy("probabilities").shape == (1, 1000)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to the TLS port: closed unanswered
        urllib.request.urlopen(f"http://{target}/v2/health/live", timeout=10)


def test_the_size_limit_is_checked_before_the_body_is_read(make_server):
    running = make_server(http_port=free_port(), max_message_mb=1, max_images_per_request=2)
    target = running.http_target
    status, _, text = request(target, "/v2/models/resnet18/infer", b"x" * ((1 << 20) + 1))
    assert status == 413 and "--max-message-mb" in json.loads(text)["error"]
    with tc.InferenceServerClient(target) as client:
        assert client.infer("resnet18", [bytes_input(JPEGS[:2])]).as_numpy("probabilities").shape == (2, 1000)
        with pytest.raises(InferenceServerException) as caught:  # 3 images: over the request limit
            client.infer("resnet18", [bytes_input(JPEGS)])
        assert caught.value.status() == "400" and "over the limit of 2" in caught.value.message()


def unload_and_load_again(client: tc.InferenceServerClient) -> None:
    """The repository extension over HTTP: unloaded, the server is not ready and inference is 503; loaded
    again, it serves."""
    tensor = bytes_input(JPEGS[:1])
    client.unload_model("resnet18")
    assert not client.is_server_ready() and not client.is_model_ready("resnet18")
    with pytest.raises(InferenceServerException) as caught:
        client.infer("resnet18", [tensor])
    assert caught.value.status() == "503" and "unloaded" in caught.value.message()
    assert client.get_model_repository_index() == [
        {"name": name, "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
        for name in ("resnet18", "resnet18_uint8")]
    client.load_model("resnet18")
    wait_for(client.is_server_ready, timeout=60)
    assert client.infer("resnet18", [tensor]).as_numpy("probabilities").shape == (1, 1000)
    assert client.get_model_repository_index()[0]["state"] == "READY"


def test_a_full_queue_is_429_while_accepted_work_is_answered(make_server, faults):
    busy = make_server(http_port=free_port(), max_queue=2, runner=faults.runner, fair_share="off")
    faults.set("hold")  # the engine holds its batches' scores: the accepted pair keeps both slots of the queue

    async def overload():
        async with tc_aio.InferenceServerClient(busy.http_target) as client:
            accepted = asyncio.ensure_future(client.infer("resnet18", [bytes_input(JPEGS[:2])]))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: busy.sample("resnet_batches_in_flight", device="cpu") == 1)
            with pytest.raises(InferenceServerException) as caught:
                await client.infer("resnet18", [bytes_input(JPEGS[:1])])
            assert not accepted.done()
            faults.clear()
            return caught.value, await accepted

    refused, accepted = asyncio.run(overload())
    assert refused.status() == "429" and "--max-queue of 2 images" in refused.message()
    assert accepted.as_numpy("probabilities").shape == (2, 1000)
    assert busy.sample("resnet_requests_total", device="cpu", code="RESOURCE_EXHAUSTED", protocol="http") == 1


@pytest.mark.slow
def test_the_front_ends_share_the_http_port(weights_file):
    """resnet-server with two front-ends, as users run it: both bind the HTTP port the first one got, each
    answers some of the connections the kernel spreads over them, a model unloaded and loaded through one is so
    for both, as are trace settings, a file of weights sent over HTTP is served, and SIGTERM ends the whole set."""
    http_port = free_port()
    workers = Workers(str(weights_file[0]), "--http-port", str(http_port), "--model-control", "explicit",
                      "--otlp-endpoint", "127.0.0.1:9")  # tracing on (spans to nowhere), so its settings change
    try:
        port, pids = workers.serving()
        assert workers.count(f"HTTP on 127.0.0.1:{http_port}") == 2 and workers.http_port() == http_port
        series = 'resnet_requests_total{{code="OK",device="cpu",protocol="http",worker="{}"}}'
        for _ in range(40):  # a connection each: the kernel spreads them over the front-ends
            with tc.InferenceServerClient(f"127.0.0.1:{http_port}") as client:
                assert client.infer("resnet18", [bytes_input(JPEGS[:1])]).as_numpy("probabilities").shape == (1, 1000)
            if all(scraped_value(workers.metrics_port, series.format(index)) > 0 for index in (0, 1)):
                break
        else:
            raise AssertionError("40 connections did not reach both front-ends")
        with tc.InferenceServerClient(f"127.0.0.1:{http_port}") as client:
            unload_and_load_again(client)
            assert client.update_trace_settings(settings={"trace_level": ["OFF"]})["trace_level"] == ["OFF"]
            with tc_grpc.InferenceServerClient(f"127.0.0.1:{port}") as over_grpc:
                level = over_grpc.get_trace_settings(as_json=True)["settings"]["trace_level"]["value"]
            assert level == ["OFF"]
            served = int(client.get_model_metadata("resnet18")["versions"][0])
            client.load_model("resnet18", files={"file:1/weights.pt": weights_file[0].read_bytes()})
            wait_for(lambda: client.get_model_metadata("resnet18")["versions"] == [str(served + 1)], timeout=60)
            assert client.infer("resnet18", [bytes_input(JPEGS[:1])]).get_response()["model_version"] == \
                str(served + 1)
        workers.terminate(pids)
    finally:
        workers.close()


def test_auth_health_closes_the_health_paths_too(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("health-secret\n")
    running = make_server(http_port=free_port(), auth_token_file=str(tokens), auth_health=True)
    status, headers, _ = request(running.http_target, "/v2/health/ready")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert request(running.http_target, "/v2/health/ready", headers={"Authorization": "Bearer health-secret"})[0] == 200


def test_a_body_that_does_not_arrive_in_time_is_408_and_the_server_serves_on(make_server, monkeypatch):
    """A slow client's body: refused once the deadline passes (shortened here through the module's constant, the
    front-end running in this process), its connection freed."""
    from resnet_server.frontend import http_answers

    monkeypatch.setattr(http_answers, "BODY_SECONDS", 0.5)
    running = make_server(http_port=free_port())
    with socket.create_connection(("127.0.0.1", running.app.http.port), timeout=30) as slow:
        slow.sendall(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        answer = slow.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5s" in answer
    assert request(running.http_target, "/v2/health/ready")[0] == 200


KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"  # .ci/run makes it: pip install kserve


@pytest.mark.slow
@pytest.mark.skipif(not KSERVE_PYTHON.exists() and not IN_CI, reason="no .venv-kserve (python -m venv .venv-kserve "
                    "&& .venv-kserve/bin/pip install kserve): the SDK pins protobuf < 7")
def test_the_kserve_sdks_rest_client_answers_as_grpc_does(server, triton_grpc, tmp_path):
    images = np.stack([image[:224, :224] for image in IMAGES[:2]])
    np.save(tmp_path / "images.npy", images)
    done = subprocess.run([str(KSERVE_PYTHON), str(ROOT / "tests" / "kserve_rest_client.py"),
                           f"http://{server.http_target}", str(tmp_path / "images.npy")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    assert read["live"] and read["ready"] and read["model_ready"]
    assert read["id"] == "kserve-1" and read["model_name"] == "resnet18_uint8"
    assert set(read["outputs"]) == {"probabilities", "top_k_indices", "top_k_probabilities", "top_k_labels"}
    np.testing.assert_allclose(read["outputs"]["probabilities"], grpc_probabilities(
        triton_grpc, "resnet18_uint8", images, "UINT8"), atol=1e-6, rtol=0)
