"""Triton's system shared-memory extension, driven by the unmodified tritonclient and its shared-memory utility
(regions under /dev/shm): inputs and outputs by reference equal to answers by value, every refusal with its
code and the server serving after it, regions shared by every front-end, and owned by their token."""

from __future__ import annotations

import json
import os
import secrets
import signal
import struct
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from resnet_client import Client
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_client.cli import main as client_main
from tests.helpers import encode, free_port, load_script, needs_perf_analyzer, random_rgb, scraped_value, wait_for
from tests.server_process import Workers

with warnings.catch_warnings():  # tritonclient 2.41's shared-memory utility imports pkg_resources
    warnings.simplefilter("ignore", UserWarning)
    import tritonclient.utils.shared_memory as shm

IMAGES = np.stack([random_rgb(900 + i, 224, 224) for i in range(2)])
PROBABILITIES_BYTES = 2 * 1000 * 4


@contextmanager
def region(size: int):
    """A fresh region under /dev/shm (tritonclient's utility), destroyed at the end."""
    key = f"/test-{secrets.token_hex(6)}"
    handle = shm.create_shared_memory_region(key.strip("/"), key, size)
    try:
        yield key, handle
    finally:
        shm.destroy_shared_memory_region(handle)


def infer_by_reference(client: tc.InferenceServerClient, images: np.ndarray, datatype: str = "UINT8",
                       model: str = "resnet18_uint8", name: str = "in", outputs: str = "out") -> tc.InferResult:
    tensor = tc.InferInput("input", list(images.shape), datatype)
    tensor.set_shared_memory(name, images.nbytes)
    output = tc.InferRequestedOutput("probabilities")
    output.set_shared_memory(outputs, PROBABILITIES_BYTES)
    return client.infer(model, [tensor], outputs=[output])


def by_value(client: tc.InferenceServerClient, images: np.ndarray, datatype: str = "UINT8",
             model: str = "resnet18_uint8") -> np.ndarray:
    tensor = tc.InferInput("input", list(images.shape), datatype)
    tensor.set_data_from_numpy(images)
    return client.infer(model, [tensor]).as_numpy("probabilities")


@pytest.fixture()
def shm_server(make_server):
    return make_server(allow_client_shm=True)


def test_inputs_and_outputs_by_reference_equal_answers_by_value(shm_server, reference):
    client = tc.InferenceServerClient(shm_server.target)
    assert "system_shared_memory" in client.get_server_metadata().extensions
    with region(IMAGES.nbytes) as (in_key, inputs), region(PROBABILITIES_BYTES) as (out_key, outputs):
        shm.set_shared_memory_region(inputs, [IMAGES])
        client.register_system_shared_memory("in", in_key, IMAGES.nbytes)
        client.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES)
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["in"] == {"name": "in", "key": in_key, "byte_size": str(IMAGES.nbytes)}
        result = infer_by_reference(client, IMAGES)
        answered = result.get_output("probabilities")
        assert list(answered.shape) == [2, 1000] and answered.parameters["shared_memory_region"].string_param == "out"
        written = shm.get_contents_as_numpy(outputs, np.float32, [2, 1000])
        np.testing.assert_array_equal(written, by_value(client, IMAGES))
        expected = [reference.probabilities(reference.input_from_array(image)) for image in IMAGES]
        np.testing.assert_allclose(written, np.stack(expected), atol=1e-4)
        # The float32 input, normalised by the caller, from the same kind of region.
        floats = np.stack([reference.input_from_array(image).numpy() for image in IMAGES])
        with region(floats.nbytes) as (float_key, float_handle):
            shm.set_shared_memory_region(float_handle, [floats])
            client.register_system_shared_memory("floats", float_key, floats.nbytes)
            result = infer_by_reference(client, floats, "FP32", "resnet18", name="floats")
            np.testing.assert_allclose(shm.get_contents_as_numpy(outputs, np.float32, [2, 1000]),
                                       by_value(client, floats, "FP32", "resnet18"), atol=1e-6)
        client.unregister_system_shared_memory()  # every region
        assert client.get_system_shared_memory_status(as_json=True) == {}


def test_encoded_images_by_reference_at_an_offset(shm_server):
    client = tc.InferenceServerClient(shm_server.target)
    jpegs = np.array([encode(image) for image in IMAGES], dtype=np.object_)
    serialized = b"".join(struct.pack("<I", len(jpeg)) + jpeg for jpeg in jpegs)  # Triton's BYTES layout
    with region(64 + len(serialized)) as (key, handle):
        shm.set_shared_memory_region(handle, [np.frombuffer(serialized, np.uint8)], offset=64)
        client.register_system_shared_memory("jpegs", key, len(serialized), offset=64)
        tensor = tc.InferInput("input", [2], "BYTES")
        tensor.set_shared_memory("jpegs", len(serialized))
        from_region = client.infer("resnet18", [tensor]).as_numpy("probabilities")
        tensor = tc.InferInput("input", [2], "BYTES")
        tensor.set_data_from_numpy(jpegs)
        np.testing.assert_array_equal(from_region, client.infer("resnet18", [tensor]).as_numpy("probabilities"))


def test_off_by_default_and_cuda_memory_is_not_offered(server):
    client = tc.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException) as refused:
        client.register_system_shared_memory("in", "/anything", 16)
    assert refused.value.status() == "StatusCode.PERMISSION_DENIED" and "--allow-client-shm" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.get_system_shared_memory_status()
    assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
    # What perf_analyzer calls even in system mode answers OK, with nothing registered; registering is refused.
    assert client.get_cuda_shared_memory_status(as_json=True) == {}
    client.unregister_cuda_shared_memory()
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
        oip_grpc.GRPCInferenceServiceStub(channel).CudaSharedMemoryRegister(
            oip.CudaSharedMemoryRegisterRequest(name="gpu", raw_handle=b"x", byte_size=16))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("key, why", [
    ("/../etc/passwd", "not a POSIX shared-memory name"),
    ("etc/passwd", "not a POSIX shared-memory name"),
    ("//dev-shm", "not a POSIX shared-memory name"),
    ("..", "not a POSIX shared-memory name"),
    ("/sem.mp-anything", "reserved"),
    ("/resnet-slab", "reserved"),
    ("//resnet-slab", "not a POSIX shared-memory name"),  # the leading-slash bypass of a reserved prefix
    ("/RESNET-slab", "reserved"),
    ("/a\x00b", "not a POSIX shared-memory name"),
    (f"/missing-{secrets.token_hex(4)}", "cannot open"),
])
def test_a_key_outside_dev_shm_or_reserved_is_refused(shm_server, key, why):
    client = tc.InferenceServerClient(shm_server.target)
    with pytest.raises(InferenceServerException) as refused:
        client.register_system_shared_memory("bad", key, 16)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and why in refused.value.message()
    assert client.get_system_shared_memory_status(as_json=True) == {}
    assert by_value(client, IMAGES[:1]).shape == (1, 1000)  # serving


def test_a_symbolic_link_under_dev_shm_is_refused(shm_server, tmp_path):
    client = tc.InferenceServerClient(shm_server.target)
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = f"test-link-{secrets.token_hex(4)}"
    os.symlink(target, f"/dev/shm/{link}")
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("link", link, 16)
    finally:
        os.unlink(f"/dev/shm/{link}")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "cannot open" in refused.value.message()


def test_out_of_bounds_and_truncated_regions_fail_the_request_not_the_server(shm_server):
    client = tc.InferenceServerClient(shm_server.target)
    with region(IMAGES.nbytes) as (key, handle), region(PROBABILITIES_BYTES) as (out_key, _):
        shm.set_shared_memory_region(handle, [IMAGES])
        with pytest.raises(InferenceServerException) as refused:  # larger than the file
            client.register_system_shared_memory("big", key, IMAGES.nbytes + 1)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "fewer than" in refused.value.message()
        client.register_system_shared_memory("in", key, IMAGES.nbytes)
        client.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES)
        tensor = tc.InferInput("input", [1, 224, 224, 3], "UINT8")
        tensor.set_shared_memory("in", IMAGES[0].nbytes, offset=IMAGES.nbytes - 10)  # past the region's end
        with pytest.raises(InferenceServerException) as refused:
            client.infer("resnet18_uint8", [tensor])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "outside" in refused.value.message()
        # The client cuts its file short after registering: the read fails the request, no SIGBUS.
        os.truncate(f"/dev/shm/{key.strip('/')}", 1000)
        with pytest.raises(InferenceServerException) as refused:
            infer_by_reference(client, IMAGES)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "cut short" in refused.value.message()
    assert by_value(client, IMAGES[:1]).shape == (1, 1000)  # serving


def test_another_tokens_regions_are_invisible_to_it(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    running = make_server(allow_client_shm=True, auth_token_file=str(tokens))
    alice = tc.InferenceServerClient(running.target)
    bob = tc.InferenceServerClient(running.target)
    as_alice, as_bob = {"authorization": "Bearer alice-token"}, {"authorization": "Bearer bob-token"}
    with region(IMAGES.nbytes) as (key, handle), region(PROBABILITIES_BYTES) as (out_key, _):
        shm.set_shared_memory_region(handle, [IMAGES])
        alice.register_system_shared_memory("in", key, IMAGES.nbytes, headers=as_alice)
        alice.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES, headers=as_alice)
        assert bob.get_system_shared_memory_status(as_json=True, headers=as_bob) == {}
        tensor = tc.InferInput("input", list(IMAGES.shape), "UINT8")
        tensor.set_shared_memory("in", IMAGES.nbytes)
        with pytest.raises(InferenceServerException) as refused:
            bob.infer("resnet18_uint8", [tensor], headers=as_bob)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "no shared-memory region" in \
            refused.value.message()
        with pytest.raises(InferenceServerException) as refused:
            bob.unregister_system_shared_memory("in", headers=as_bob)
        assert refused.value.status() == "StatusCode.NOT_FOUND"
        bob.unregister_system_shared_memory(headers=as_bob)  # all of bob's: none of alice's
        # Alice's file is hers: Bob cannot register a region of it (to read her images or overwrite her outputs).
        with pytest.raises(InferenceServerException) as refused:
            bob.register_system_shared_memory("mine", out_key, PROBABILITIES_BYTES, headers=as_bob)
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED" and "another client" in \
            refused.value.message()
        # Bob may use the same name for a region of his own.
        with region(IMAGES.nbytes) as (bobs_key, _):
            bob.register_system_shared_memory("in", bobs_key, IMAGES.nbytes, headers=as_bob)
        assert set(alice.get_system_shared_memory_status(as_json=True, headers=as_alice)["regions"]) == {"in", "out"}
        tensor.set_shared_memory("in", IMAGES.nbytes)
        assert alice.infer("resnet18_uint8", [tensor], headers=as_alice).as_numpy("probabilities").shape == (2, 1000)


def test_a_key_registered_for_one_file_refuses_another_file_under_it(shm_server):
    client = tc.InferenceServerClient(shm_server.target)
    key = f"/test-{secrets.token_hex(6)}"
    path = Path("/dev/shm") / key.strip("/")
    try:
        path.write_bytes(bytes(64))
        client.register_system_shared_memory("first", key, 64)
        path.unlink()
        path.write_bytes(bytes(64))  # the client makes a new file under the same key
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("second", key, 64)
        assert refused.value.status() == "StatusCode.ALREADY_EXISTS" and "another file" in refused.value.message()
        client.unregister_system_shared_memory("first")
        client.register_system_shared_memory("second", key, 64)  # once the old file's regions are gone
        client.unregister_system_shared_memory("second")
    finally:
        path.unlink(missing_ok=True)


def test_encoded_images_read_from_a_region_are_bounded_by_the_message_limit(make_server):
    running = make_server(allow_client_shm=True, max_message_mb=1)
    client = tc.InferenceServerClient(running.target)
    size = 2 << 20
    with region(size) as (key, handle):
        shm.set_shared_memory_region(handle, [np.frombuffer(struct.pack("<I", size - 4) + bytes(size - 4), np.uint8)])
        client.register_system_shared_memory("big", key, size)
        tensor = tc.InferInput("input", [1], "BYTES")
        tensor.set_shared_memory("big", size)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("resnet18", [tensor])
        client.unregister_system_shared_memory("big")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"a BYTES input of {size} bytes from a shared-memory region" in refused.value.message()


def test_an_output_region_too_small_is_refused_before_compute_and_nothing_is_written(shm_server):
    client = tc.InferenceServerClient(shm_server.target)
    batches = shm_server.sample("resnet_batch_size_count", device="cpu")
    with region(PROBABILITIES_BYTES) as (key, handle):
        shm.set_shared_memory_region(handle, [np.full(PROBABILITIES_BYTES, 7, np.uint8)])
        client.register_system_shared_memory("small", key, PROBABILITIES_BYTES)
        indices = tc.InferRequestedOutput("top_k_indices")
        indices.set_shared_memory("small", 8)  # room for one index, two images asked
        probabilities = tc.InferRequestedOutput("probabilities")
        probabilities.set_shared_memory("small", PROBABILITIES_BYTES)
        tensor = tc.InferInput("input", list(IMAGES.shape), "UINT8")
        tensor.set_data_from_numpy(IMAGES)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("resnet18_uint8", [tensor], outputs=[probabilities, indices])
        written = shm.get_contents_as_numpy(handle, np.uint8, [PROBABILITIES_BYTES]).copy()  # unmapped at the end
        client.unregister_system_shared_memory("small")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'top_k_indices' needs 80 bytes" in refused.value.message()
    assert (written == 7).all()  # no output was written
    assert shm_server.sample("resnet_batch_size_count", device="cpu") == batches  # nothing was computed


def test_limits_on_regions_and_bytes(make_server):
    running = make_server(allow_client_shm=True, max_shm_regions=2, max_shm_mb=1)
    client = tc.InferenceServerClient(running.target)
    with region(2 << 20) as (key, _):
        client.register_system_shared_memory("a", key, 1 << 19)
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("a", key, 16)
        assert refused.value.status() == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("b", key, (1 << 19) + 1)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "--max-shm-mb" in refused.value.message()
        client.register_system_shared_memory("b", key, 16)
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("c", key, 16)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "--max-shm-regions" in \
            refused.value.message()


def test_unregistering_a_region_in_use_lets_the_request_finish(make_server, faults):
    running = make_server(allow_client_shm=True, runner=faults.runner)
    client = tc.InferenceServerClient(running.target)
    with region(IMAGES.nbytes) as (key, handle), region(PROBABILITIES_BYTES) as (out_key, outputs):
        shm.set_shared_memory_region(handle, [IMAGES])
        client.register_system_shared_memory("in", key, IMAGES.nbytes)
        client.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES)
        expected = by_value(client, IMAGES)
        faults.set("hold")  # the batch's scores land only once released: the request is in flight, using both
        answered: list = []
        caller = threading.Thread(target=lambda: answered.append(infer_by_reference(client, IMAGES)))
        caller.start()
        wait_for(lambda: running.sample("resnet_batches_in_flight", device="cpu") == 1)
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status(as_json=True) == {}
        faults.clear()
        caller.join(60)
        assert answered, "the request in flight was not answered"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs, np.float32, [2, 1000]), expected)
        with pytest.raises(InferenceServerException) as refused:  # gone for the next one
            infer_by_reference(client, IMAGES)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert not open_test_regions()  # the front-end (a thread of this process) closed what it held


def open_test_regions() -> list[str]:
    """The files of this test's regions that this process still has open."""
    opened = []
    for name in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{name}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
    return [path for path in opened if path.startswith("/dev/shm/test-")]


@pytest.mark.slow
@needs_perf_analyzer
def test_a_region_registered_through_one_front_end_serves_through_every_one_and_their_replacements(weights_file):
    workers = Workers(str(weights_file[0]), "--allow-client-shm")
    try:
        port, pids = workers.serving()
        target = f"127.0.0.1:{port}"
        with region(IMAGES.nbytes) as (key, handle), region(PROBABILITIES_BYTES) as (out_key, outputs):
            shm.set_shared_memory_region(handle, [IMAGES])
            registrar = tc.InferenceServerClient(target)
            registrar.register_system_shared_memory("in", key, IMAGES.nbytes)
            registrar.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES)
            expected = by_value(registrar, IMAGES)
            answered_by_each(workers, target, expected, outputs)
            # A front-end killed: its replacement opens every region registered before it started.
            os.kill(pids[0], signal.SIGKILL)
            workers.serving(3)
            answered_by_each(workers, target, expected, outputs)
            # Triton's own load generator, its regions registered, used and unregistered through both.
            figures = load_script("perf_analyzer").run(target, 4, window_requests=20, first_windows=True,
                                                        input_kind="uint8", shared_memory="system")
            assert figures["requests"] >= 20 and figures["successes"] == figures["inferences"]
            # It unregisters every region as it ends (an empty name): without tokens, every client's, as on Triton.
            assert registrar.get_system_shared_memory_status(as_json=True) == {}
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(timeout=60) == 0
    finally:
        workers.close()


def answered_by_each(workers: Workers, target: str, expected: np.ndarray, outputs) -> None:
    """Requests by reference on new connections until both front-ends serving now have answered some: each
    lists the regions, and each answer is the one by value."""
    def counts() -> list[float]:
        series = 'resnet_requests_total{{code="OK",device="cpu",protocol="grpc",worker="{}"}}'
        return [scraped_value(workers.metrics_port, series.format(index)) for index in (0, 1)]

    before = counts()
    for _ in range(40):
        # A connection of its own (gRPC shares one per target otherwise): the kernel spreads them over the front-ends.
        client = tc.InferenceServerClient(target, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {"in", "out"}
        infer_by_reference(client, IMAGES)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs, np.float32, [2, 1000]), expected)
        client.close()
        if all(now > then for now, then in zip(counts(), before, strict=True)):
            return
    raise AssertionError(f"40 connections did not reach both front-ends: requests {before} -> {counts()}")


def test_our_client_classifies_from_a_region_of_its_own(shm_server, reference):
    with Client(shm_server.target) as client:
        by_value_results = client.classify(list(IMAGES), full=True, top_k=3)
        with client.shared_memory(4 << 20) as region:
            assert os.path.exists(f"/dev/shm/{region.name}")
            results = region.classify(list(IMAGES), top_k=3)
            jpegs = region.classify([encode(image) for image in IMAGES], top_k=3)
            with pytest.raises(ValueError, match="the region holds"):
                region.classify([IMAGES[0]] * 40)
        assert not os.path.exists(f"/dev/shm/{region.name}")  # unregistered and removed
    assert tc.InferenceServerClient(shm_server.target).get_system_shared_memory_status(as_json=True) == {}
    for ours, theirs in zip(results, by_value_results, strict=True):
        np.testing.assert_allclose(ours.probabilities, theirs.probabilities, atol=1e-6)
        assert [(s.index, s.label) for s in ours.top_k] == [(s.index, s.label) for s in theirs.top_k]
    expected = reference.probabilities(reference.input_from_bytes(encode(IMAGES[0])))
    np.testing.assert_allclose(jpegs[0].probabilities, expected, atol=1e-4)


@pytest.mark.parametrize("kind", ["uint8", "fp32", "jpeg"])
def test_bench_sends_every_callers_images_by_reference(make_server, capsys, kind):
    running = make_server(allow_client_shm=True, metrics_port=free_port())
    code = client_main(["bench", "--server", running.target, "--shared-memory", "system", "--concurrency", "2",
                        "--duration", "1.5", "--warmup", "0.5", "--input", kind, "--images-per-request", "2",
                        "--json", "--quiet", "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"])
    assert code == 0
    point = json.loads(capsys.readouterr().out)
    assert point["shared_memory"] == "system" and point["ok"] > 0 and point["errors"] == {}
    assert running.sample("resnet_requests_total", device="cpu", code="OK") >= point["ok"]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"rc-{os.getpid()}-")]  # removed


def test_bench_by_reference_says_what_is_wrong_at_once(server, capsys):
    assert client_main(["bench", "--server", server.target, "--shared-memory", "system", "--input", "uint8",
                        "--duration", "1", "--quiet"]) == 1
    said = capsys.readouterr().err
    assert "the first call, before any load, failed" in said and "--allow-client-shm" in said
    assert client_main(["bench", "--server", server.target, "--shared-memory", "system", "--rate", "5"]) == 2
    assert "--shared-memory system is a closed loop" in capsys.readouterr().err


def test_stream_messages_name_regions_too(shm_server):
    triton = tc.InferenceServerClient(shm_server.target)
    with region(IMAGES.nbytes) as (key, handle):
        shm.set_shared_memory_region(handle, [IMAGES])
        triton.register_system_shared_memory("in", key, IMAGES.nbytes)
        one = IMAGES[0].nbytes
        requests = [oip.ModelInferRequest(model_name="resnet18_uint8", id=str(index), inputs=[
            oip.ModelInferRequest.InferInputTensor(name="input", datatype="UINT8", shape=[1, 224, 224, 3], parameters={
                "shared_memory_region": oip.InferParameter(string_param="in"),
                "shared_memory_offset": oip.InferParameter(int64_param=index * one),
                "shared_memory_byte_size": oip.InferParameter(int64_param=one)})]) for index in range(2)]
        requests.append(oip.ModelInferRequest(model_name="resnet18_uint8", id="bad", inputs=[
            oip.ModelInferRequest.InferInputTensor(name="input", datatype="UINT8", shape=[1, 224, 224, 3], parameters={
                "shared_memory_region": oip.InferParameter(string_param="nowhere"),
                "shared_memory_byte_size": oip.InferParameter(int64_param=one)})]))
        # One message in flight at a time, so each is a batch of one as its by-value twin is: two messages in one
        # batch run at another batch size, whose CPU kernels round the last bits differently.
        answered = threading.Semaphore(0)

        def one_at_a_time():
            for request in requests:
                yield request
                answered.acquire(timeout=60)

        answers = []
        with grpc.insecure_channel(shm_server.target) as channel:
            for answer in oip_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(one_at_a_time(), timeout=60):
                answers.append(answer)
                answered.release()
        assert [answer.infer_response.id for answer in answers] == ["0", "1", "bad"]
        for index, answer in enumerate(answers[:2]):
            assert not answer.error_message
            probabilities = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
            np.testing.assert_array_equal(probabilities, by_value(triton, IMAGES[index:index + 1])[0])
        assert answers[2].error_message.startswith("[INVALID_ARGUMENT] no shared-memory region 'nowhere'")


def test_the_extension_over_http_equals_grpc(make_server):
    """Register, infer by reference and unregister through tritonclient.http: the same regions, the same answer
    in the output region as by value over gRPC."""
    import tritonclient.http as tc_http

    running = make_server(allow_client_shm=True, http_port=free_port())
    client = tc_http.InferenceServerClient(running.http_target)
    with region(IMAGES.nbytes) as (in_key, inputs), region(PROBABILITIES_BYTES) as (out_key, outputs):
        shm.set_shared_memory_region(inputs, [IMAGES])
        client.register_system_shared_memory("in", in_key, IMAGES.nbytes)
        client.register_system_shared_memory("out", out_key, PROBABILITIES_BYTES)
        assert {"name": "in", "key": in_key, "offset": 0, "byte_size": IMAGES.nbytes} in [
            {"offset": 0, **status} for status in client.get_system_shared_memory_status()]
        tensor = tc_http.InferInput("input", list(IMAGES.shape), "UINT8")
        tensor.set_shared_memory("in", IMAGES.nbytes)
        output = tc_http.InferRequestedOutput("probabilities", binary_data=True)
        output.set_shared_memory("out", PROBABILITIES_BYTES)
        result = client.infer("resnet18_uint8", [tensor], outputs=[output])
        (answered,) = result.get_response()["outputs"]
        assert answered["parameters"]["shared_memory_region"] == "out" and "data" not in answered
        with tc.InferenceServerClient(running.target) as grpc_client:
            np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs, np.float32, [2, 1000]),
                                          by_value(grpc_client, IMAGES))
        client.unregister_system_shared_memory("in")
        assert [status["name"] for status in client.get_system_shared_memory_status()] == ["out"]
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    client.close()
