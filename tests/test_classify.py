"""The whole request path over real gRPC, checked against torchvision computed in the test."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.messages import build_request, parse_response
from resnet_server.common.config import parse_config
from tests.helpers import async_methods_seen, encode, method_name, random_rgb, wait_for

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as connected:
        yield connected


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("temperature", [1.0, 2.5, 0.3])
def test_encoded_probabilities_match_torchvision(client, reference, fmt, temperature):
    data = encode(random_rgb(7, 300, 400), fmt)
    (result,) = client.classify([data], temperature=temperature, full=True, top_k=5)
    expected = reference.probabilities(reference.input_from_bytes(data), temperature)
    np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)
    assert result.temperature == pytest.approx(temperature)
    assert result.device == "cpu"
    top = np.argsort(-expected)[:5]
    assert [score.index for score in result.top_k] == top.tolist()
    labels = client.model_info().labels
    assert [score.label for score in result.top_k] == [labels[i] for i in top]
    assert [score.probability for score in result.top_k] == pytest.approx(expected[top].tolist(), abs=TOLERANCE)


def test_raw_uint8_and_float_inputs_match_torchvision(client, reference):
    array = random_rgb(11, 256, 300)
    model_input = reference.input_from_array(array)
    expected = reference.probabilities(model_input)
    raw_u8, raw_f32 = client.classify([array, model_input.numpy()], full=True)
    np.testing.assert_allclose(raw_u8.probabilities, expected, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(raw_f32.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_temperature_maths_on_returned_logits(client):
    data = encode(random_rgb(3))
    (hot,) = client.classify([data], temperature=4.0, full=True, logits=True)
    logits = np.asarray(hot.logits, dtype=np.float64)
    expected = np.exp(logits / 4.0 - np.max(logits / 4.0))
    expected /= expected.sum()
    np.testing.assert_allclose(hot.probabilities, expected, atol=1e-6)
    (cold,) = client.classify([data], temperature=0.25, full=True)
    # Lower T sharpens: the top class gains probability; argmax is unchanged.
    assert np.argmax(cold.probabilities) == np.argmax(hot.probabilities)
    assert max(cold.probabilities) > max(hot.probabilities)
    assert sum(hot.probabilities) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("precision, tolerance", [("bf16", 0.02), ("fp16", 0.005)])
def test_reduced_precision_on_the_cpu_stays_near_the_fp32_reference(make_server, reference, precision, tolerance):
    # bf16 on the CPU is the fast path on Xeons with AMX (README, Performance); it keeps 8 bits of mantissa,
    # fp16 11: measured here 0.45-0.65% and 0.05% of the logits' range; the softmax (always fp32) adds nothing.
    running = make_server(precision=precision)
    arrays = [random_rgb(seed, 240, 320) for seed in (61, 62, 63)]
    with Client(running.target, timeout=60) as client:
        results = client.classify(arrays, full=True, logits=True)
    for result, array in zip(results, arrays, strict=True):
        want = reference.logits(reference.input_from_array(array).unsqueeze(0))[0].numpy()
        np.testing.assert_allclose(result.logits, want, atol=tolerance * np.abs(want).max(), rtol=0)
        probabilities = np.exp(np.asarray(result.logits, np.float64) - max(result.logits))
        np.testing.assert_allclose(result.probabilities, probabilities / probabilities.sum(), atol=1e-6)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_bind_address_serves_with_or_without_brackets(make_server, reference):
    """gRPC reads ``::1:PORT`` as no address at all; the front-end puts an IPv6 host in brackets."""
    assert parse_config(["--host", "[::1]"], env={}).host == parse_config(["--host", "::1"], env={}).host == "::1"
    running = make_server(host="::1")
    assert running.target.startswith("[::1]:")
    array = random_rgb(31, 240, 320)
    with Client(running.target, timeout=60) as client:
        (result,) = client.classify([array], full=True)
    expected = reference.probabilities(reference.input_from_array(array))
    np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_default_temperature_and_top_k(client):
    (result,) = client.classify([encode(random_rgb(4))])
    assert result.temperature == 1.0
    assert len(result.top_k) == 5 and result.probabilities is None
    probabilities = [score.probability for score in result.top_k]
    assert probabilities == sorted(probabilities, reverse=True)
    (everything,) = client.classify([encode(random_rgb(4))], top_k=1000)
    assert sorted(score.index for score in everything.top_k) == list(range(1000))


@pytest.mark.slow
def test_batches_form_under_concurrency_and_results_do_not_depend_on_them(server, reference):
    images = [encode(random_rgb(100 + i)) for i in range(16)]
    before_batches = server.sample("resnet_batch_size_count", device="cpu")
    before_images = server.sample("resnet_batch_size_sum", device="cpu")

    async def fire():
        async with AsyncClient(server.target, timeout=120) as aclient:
            return await asyncio.gather(*(aclient.classify([image], full=True) for image in images))

    results = asyncio.run(fire())
    batches = server.sample("resnet_batch_size_count", device="cpu") - before_batches
    batched_images = server.sample("resnet_batch_size_sum", device="cpu") - before_images
    assert batched_images == 16
    assert batches < 16, "concurrent requests should share forward passes"
    for image, (result,) in zip(images, results, strict=True):
        alone = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, alone, atol=TOLERANCE, rtol=0)


def test_client_side_batch_mixed_temperatures_equal_single_requests(client):
    images = [encode(random_rgb(200 + i)) for i in range(5)]
    together = client.classify(images, temperature=1.7, full=True)
    for image, batched in zip(images, together, strict=True):
        (single,) = client.classify([image], temperature=1.7, full=True)
        np.testing.assert_allclose(batched.probabilities, single.probabilities, atol=TOLERANCE, rtol=0)


def test_stream_answers_in_order(client, reference):
    images = [encode(random_rgb(300 + i)) for i in range(6)]
    requests = [build_request([image], temperature=1.0 + i, full=True) for i, image in enumerate(images)]
    answers = list(client.classify_stream(requests))
    assert len(answers) == 6
    for i, (image, (result,)) in enumerate(zip(images, answers, strict=True)):
        assert result.temperature == pytest.approx(1.0 + i)
        expected = reference.probabilities(reference.input_from_bytes(image), 1.0 + i)
        np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


STREAMED = [encode(random_rgb(700 + i)) for i in range(48)]  # more than any fixed depth a stream once had (32)


def held_stream(running, faults, images: list):
    """A request for each image, sent at once on one ClassifyStream while the engine holds its batches' scores;
    once all are in the server (or one was refused), the hold is lifted. The answers, and the status that ended
    the stream (None if it ended OK)."""
    faults.set("hold")
    count = len(images)
    requests = [build_request([image], full=True) for image in images]
    with grpc.insecure_channel(running.target) as channel:
        responses = pb_grpc.ClassifierStub(channel).ClassifyStream(iter(requests), timeout=60)  # sent at once
        wait_for(lambda: running.sample("resnet_requests_in_flight", device="cpu") == count
                 or running.sample("resnet_requests_total", device="cpu", code="RESOURCE_EXHAUSTED") > 0)
        faults.clear()
        answers = []
        try:
            answers.extend(parse_response(response) for response in responses)
        except grpc.RpcError as error:
            return answers, error
    return answers, None


def test_one_stream_holds_any_number_of_requests_in_flight_and_answers_them_in_order(make_server, faults,
                                                                                    reference):
    running = make_server(runner=faults.runner)
    answers, ended = held_stream(running, faults, STREAMED)
    assert ended is None and len(answers) == len(STREAMED)  # all in flight at once, then all answered
    for image, (result,) in zip(STREAMED, answers, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_a_stream_past_the_servers_queue_is_refused_as_calls_are(make_server, faults):
    # The queue's own bound: without fair share, whose slots kept for other callers would refuse the 20th.
    running = make_server(runner=faults.runner, max_queue=20, fair_share="off")
    # Raw pixels that fit a slot need no decoding: each request takes its slots as it arrives, so the first 20
    # are the ones accepted (JPEGs take them as their decoding ends, in any order).
    answers, ended = held_stream(running, faults, [random_rgb(800 + i, 48, 64) for i in range(24)])
    assert ended is not None and ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queue of 20 images" in ended.details()
    assert len(answers) == 20  # the accepted requests before the first refused one, answered in order


def test_stream_ends_with_the_first_error_code(client):
    requests = [build_request([encode(random_rgb(1))]), build_request([b"not an image"])]
    received = []
    with pytest.raises(ClassifierError) as caught:
        for answer in client.classify_stream(requests):
            received.append(answer)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(received) == 1


def test_model_info(client, weights_file):
    info = client.model_info()
    assert info.name == "resnet18" and info.version == "1"
    assert len(info.labels) == 1000 and info.labels[0] == "tench"
    assert list(info.devices) == ["cpu"]
    assert info.default_temperature == 1.0 and info.temperature_source == "flag"
    assert info.batching.max_batch_size == 8 and info.batching.wait_for_callers_ms == 0.0
    assert info.weights == str(weights_file[0]) and info.warning == ""
    assert info.input.crop_size == 224 and info.input.resize_size == 256
    assert info.input.max_pixels == 40_000_000
    (runs,) = info.runs
    assert info.runtime == "torch" and runs == "cpu runs fp32 eagerly at batch sizes 1, 2, 3, 4, 5, 6, 7, 8"


class MethodsSeen(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """A client interceptor that notes each call's method and lets it through."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_unary_unary(self, continuation, call_details, request):
        self.methods.append(method_name(call_details))
        return continuation(call_details, request)

    def intercept_stream_stream(self, continuation, call_details, request_iterator):
        self.methods.append(method_name(call_details))
        return continuation(call_details, request_iterator)


def test_clients_pass_every_call_through_the_interceptors_they_are_given(server, reference):
    image = encode(random_rgb(900))
    expected = reference.probabilities(reference.input_from_bytes(image), 1.0)
    seen = MethodsSeen()
    with Client(server.target, timeout=60, interceptors=[seen]) as client:
        (result,) = client.classify([image], full=True)
        assert [answer for (answer,) in client.classify_stream([build_request([image])])][0].top_k
    assert seen.methods == ["/resnet.v1.Classifier/Classify", "/resnet.v1.Classifier/ClassifyStream"]
    np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)

    methods, interceptors = async_methods_seen()

    async def classify_async() -> list:
        async with AsyncClient(server.target, timeout=60, interceptors=interceptors) as client:
            return await client.classify([image], full=True)
    (result,) = asyncio.run(classify_async())
    assert methods == ["/resnet.v1.Classifier/Classify"]
    np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_health_serving(client):
    assert client.health() == "SERVING"
    assert client.health("resnet.v1.Classifier") == "SERVING"


def test_grpc_waits_for_the_methods_that_carry_pixels_and_one_generic_handler(client, monkeypatch):
    """gRPC's server loop waits on one future per registered method (and one for every other method) for each
    call it takes: only the four methods that carry pixels are registered, so a call costs gRPC a wait on five;
    the others (model info, health, reflection) are answered through the generic handler."""
    waited: list[int] = []
    wait = asyncio.wait

    async def counted(futures, *args, **kwargs):
        waited.append(len(futures := list(futures)))
        return await wait(futures, *args, **kwargs)

    monkeypatch.setattr(asyncio, "wait", counted)
    client.classify([random_rgb(3, 64, 48)])
    assert client.model_info().name == "resnet18"
    assert client.health() == "SERVING"
    assert waited and set(waited) == {5}, waited


def test_server_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
    names = {service.name for service in response.list_services_response.service}
    assert names == {"resnet.v1.Classifier", "inference.GRPCInferenceService", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection"}
