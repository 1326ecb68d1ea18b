"""New weights while serving, through the unmodified tritonclient (Triton's model repository extension), SIGHUP and
`resnet-client reload`: every answer names the version that computed it and matches that version's reference;
a refused load changes nothing; replaced processes serve the weights served now."""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tc
from safetensors.torch import save as safetensors_bytes
from tritonclient.utils import InferenceServerException

from resnet_client import Client
from tests.helpers import Reference, random_rgb, save_random_weights, scraped_value, wait_for
from tests.server_process import Workers, gone

PIXELS = random_rgb(71, 224, 224)
ENGINE = 'worker="engine-cpu"'


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, tuple[Path, Reference]]:
    """Two seeded weight files and each one's reference, by name."""
    folder = tmp_path_factory.mktemp("reload")
    made = {}
    for name, seed in (("first", 1), ("second", 2)):
        path = folder / f"{name}.pt"
        made[name] = (path, Reference(save_random_weights(path, seed)))
    return made


def expected(reference: Reference) -> np.ndarray:
    return reference.probabilities(reference.input_from_array(PIXELS))


def infer(triton: tc.InferenceServerClient, version: str = "") -> tuple[str, np.ndarray]:
    tensor = tc.InferInput("input", [1, 224, 224, 3], "UINT8")
    tensor.set_data_from_numpy(PIXELS[None])
    result = triton.infer("resnet18_uint8", [tensor], model_version=version)
    return result.get_response().model_version, result.as_numpy("probabilities")[0]


def refused(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value


class Callers:
    """Threads calling ModelInfer until stopped, each answer checked against the reference of the version it
    names."""

    def __init__(self, target: str, references: dict[str, np.ndarray]) -> None:
        self.references, self.answers, self.bad = references, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._call, args=(target,), daemon=True) for _ in range(4)]
        for thread in self._threads:
            thread.start()

    def _call(self, target: str) -> None:
        triton = tc.InferenceServerClient(target)
        while not self._stop.is_set():
            try:
                version, probabilities = infer(triton)
            except InferenceServerException as exc:
                self.bad.append(exc.status())
                continue
            if np.abs(probabilities - self.references[version]).max() > 1e-5:
                self.bad.append(f"version {version} answered another version's probabilities")
            self.answers += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


@pytest.mark.slow
def test_weights_load_while_serving_and_every_answer_names_its_version(versions, tmp_path):
    (first, first_reference), (second, second_reference) = versions["first"], versions["second"]
    temporary = tmp_path / "tmp"  # the server's temporary folder: where the supervisor keeps the clients' files
    temporary.mkdir()
    workers = Workers(str(first), "--model-control", "explicit", env={"TMPDIR": str(temporary)})
    try:
        port, frontends = workers.serving()
        target = f"127.0.0.1:{port}"
        triton = tc.InferenceServerClient(target)
        assert "model_repository" in triton.get_server_metadata().extensions
        assert [(model.name, model.version, model.state) for model in triton.get_model_repository_index().models] \
            == [("resnet18", "1", "READY"), ("resnet18_uint8", "1", "READY")]
        version, probabilities = infer(triton)
        assert version == "1" and np.abs(probabilities - expected(first_reference)).max() < 1e-5

        # A file the client sends, while four callers call: every answer is one version's, whole.
        callers = Callers(target, {"1": expected(first_reference), "2": expected(second_reference),
                                   "3": expected(first_reference)})
        wait_for(lambda: callers.answers >= 4, timeout=60)
        triton.load_model("resnet18", files={"file:1/second.pt": second.read_bytes()})
        (uploads,) = temporary.glob("resnet-weights-*")
        assert len(list(uploads.iterdir())) == 1  # the file served, kept for an engine that restarts
        served = callers.answers
        wait_for(lambda: callers.answers >= served + 4, timeout=60)
        assert infer(triton)[0] == "2"
        with Client(target) as client:
            info = client.model_info()
            assert (info.weights_version, info.weights_sha256) == (2, hashlib.sha256(second.read_bytes()).hexdigest())
            assert client.classify([PIXELS])[0].top_k  # our own API answers from version 2 too
        # No files: --weights again, though it did not change.
        triton.load_model("resnet18")
        callers.stop()
        assert callers.bad == [] and callers.answers > served
        assert infer(triton)[0] == "3"
        assert "version 3 is" in refused(infer, triton, "2").message()
        assert refused(infer, triton, "2").status() == "StatusCode.NOT_FOUND"

        refusals_change_nothing(triton, second, tmp_path)
        assert infer(triton)[0] == "3"

        # The merged /metrics: the version served, the reloads by outcome.
        assert scraped_value(workers.metrics_port, f'resnet_weights_version{{device="cpu",{ENGINE}}}') == 3
        assert scraped_value(workers.metrics_port,
                             f'resnet_weights_reloads_total{{device="cpu",outcome="loaded",{ENGINE}}}') == 2

        unload_then_load(triton, target)  # version 4
        os.kill(workers.process.pid, signal.SIGHUP)
        workers.read_until(4, "reload succeeded")
        assert infer(triton)[0] == "5"

        reloaded = subprocess.run([sys.executable, "-m", "resnet_client.cli", "--server", target, "reload", "--weights",
                                   str(second)], capture_output=True, text=True, timeout=120)
        assert reloaded.returncode == 0, reloaded.stderr
        assert reloaded.stdout.startswith("serving weights version 6 (sha256 ")

        new_processes_serve_the_weights_served_now(workers, frontends, target, expected(second_reference))
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(timeout=60) == 0
        assert list(temporary.glob("resnet-weights-*")) == []  # the clients' files went with the server
    finally:
        workers.close()


def refusals_change_nothing(triton: tc.InferenceServerClient, good: Path, tmp_path: Path) -> None:
    """Each refusal's code and what it names; the version served stays."""
    state = torch.load(good, weights_only=True)

    def saved(tensors: dict) -> bytes:
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        return buffer.getvalue()

    def load_refused(files=None, **kwargs) -> InferenceServerException:
        return refused(triton.load_model, "resnet18", files=files, **kwargs)

    truncated = load_refused({"file:1/cut.pt": good.read_bytes()[:100_000]})
    assert truncated.status() == "StatusCode.INVALID_ARGUMENT" and "cut.pt" in truncated.message()
    extra = load_refused({"file:1/extra.pt": saved({**state, "head.weight": torch.zeros(3)})})
    assert extra.status() == "StatusCode.INVALID_ARGUMENT" and "unexpected key 'head.weight'" in extra.message()
    missing = load_refused({"file:1/missing.safetensors": safetensors_bytes(
        {key: value for key, value in state.items() if key != "fc.bias"})})
    assert missing.status() == "StatusCode.INVALID_ARGUMENT" and "missing key 'fc.bias'" in missing.message()
    shape = load_refused({"file:1/shape.pt": saved({**state, "fc.weight": torch.zeros(10, 512)})})
    assert "'fc.weight' has shape (10, 512)" in shape.message()
    code = load_refused({"file:1/code.pt": saved({"fc.weight": threading.Lock})})  # not plain tensors
    assert code.status() == "StatusCode.INVALID_ARGUMENT"
    large = load_refused({"file:1/large.pt": bytes(51 << 20)})
    assert "over --max-weights-mb 50" in large.message()
    config = load_refused(config='{"max_batch_size": 3}')
    assert config.status() == "StatusCode.INVALID_ARGUMENT" and "max_batch_size" in config.message()
    unknown = refused(triton.load_model, "resnet50")
    assert unknown.status() == "StatusCode.NOT_FOUND"
    assert [model.version for model in triton.get_model_repository_index().models] == ["3", "3"]


def unload_then_load(triton: tc.InferenceServerClient, target: str) -> None:
    triton.unload_model("resnet18")
    assert not triton.is_model_ready("resnet18")
    assert [model.state for model in triton.get_model_repository_index().models] == ["UNAVAILABLE"] * 2
    assert refused(infer, triton).status() == "StatusCode.UNAVAILABLE"
    with Client(target, attempts=1) as client:
        # Not ready (the services' health), yet live (the server's own): a liveness probe restarts nothing.
        wait_for(lambda: client.health("resnet.v1.Classifier") == "NOT_SERVING")
        assert client.health("inference.GRPCInferenceService") == "NOT_SERVING" and client.health() == "SERVING"
        assert not triton.is_server_ready() and triton.is_server_live()
        triton.load_model("resnet18", config='{"name": "resnet18", "backend": "pytorch"}')  # asks for nothing new
        assert triton.is_model_ready("resnet18") and infer(triton)[0] == "4"
        wait_for(lambda: client.health("resnet.v1.Classifier") == "SERVING")


def new_processes_serve_the_weights_served_now(workers: Workers, frontends: list[int], target: str,
                                                reference: np.ndarray) -> None:
    """A front-end and an engine killed: their replacements start with version 6, not with --weights."""
    (engine,) = workers.engine_pids()
    os.kill(frontends[0], signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    workers.engine_pids(2)
    workers.read_until(3, "serving resnet18")
    wait_for(lambda: gone(frontends[0]) and gone(engine))
    for _ in range(8):  # on connections of their own: both front-ends, the new one among them
        triton = tc.InferenceServerClient(target)
        wait_for(lambda triton=triton: triton.is_model_ready("resnet18"), timeout=120)
        version, probabilities = infer(triton)
        assert version == "6" and np.abs(probabilities - reference).max() < 1e-5


def test_the_repository_answers_permission_denied_naming_the_flag_unless_explicit(server):
    triton = tc.InferenceServerClient(server.target)
    for call in (triton.load_model, triton.unload_model):
        error = refused(call, "resnet18")
        assert error.status() == "StatusCode.PERMISSION_DENIED" and "--model-control explicit" in error.message()
    assert refused(triton.get_model_repository_index).status() == "StatusCode.PERMISSION_DENIED"
    assert infer(triton)[0] == "1"


def test_with_tokens_a_load_needs_one(make_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("reload-secret\n")
    running = make_server(model_control="explicit", auth_token_file=str(tokens))
    triton = tc.InferenceServerClient(running.target)
    assert refused(triton.load_model, "resnet18").status() == "StatusCode.UNAUTHENTICATED"
    # With it, the call gets through to the repository (a front-end run alone has no supervisor to reload with).
    allowed = refused(triton.load_model, "resnet18", headers={"authorization": "Bearer reload-secret"})
    assert allowed.status() == "StatusCode.UNAVAILABLE" and "without a supervisor" in allowed.message()


@pytest.mark.slow
def test_a_rebuilt_runner_serves_the_new_weights_and_a_source_gone_bad_changes_nothing(versions, tmp_path):
    """A TorchScript graph holds its weights frozen, as inductor's does: a reload builds and warms a new runner
    beside the old. Then --weights replaced by a broken file: the reload fails on every engine, naming why, and
    the weights served stay."""
    (first, _), (second, second_reference) = versions["first"], versions["second"]
    source = tmp_path / "served.pt"
    source.write_bytes(first.read_bytes())
    workers = Workers(str(source), "--model-control", "explicit", "--torchscript")
    try:
        port, _ = workers.serving()
        triton = tc.InferenceServerClient(f"127.0.0.1:{port}")
        triton.load_model("resnet18", files={"file:1/second.pt": second.read_bytes()})
        version, probabilities = infer(triton)
        assert version == "2" and np.abs(probabilities - expected(second_reference)).max() < 1e-5
        source.write_bytes(first.read_bytes()[:4096])  # truncated
        broken = refused(triton.load_model, "resnet18")
        assert broken.status() == "StatusCode.INVALID_ARGUMENT" and "cannot load" in broken.message()
        version, probabilities = infer(triton)
        assert version == "2" and np.abs(probabilities - expected(second_reference)).max() < 1e-5
        workers.read_until(1, "reload failed")
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(timeout=60) == 0
    finally:
        workers.close()


def test_what_the_weights_are_called_follows_every_reload():
    """The review's N23: a front-end that connected while a client's file was served kept naming that (deleted)
    file after a later reload from --weights."""
    from resnet_server.common.served import ServedWeights
    from resnet_server.frontend.supervisor_client import SupervisorClient

    uploads = "/tmp/resnet-weights-x"
    control = SupervisorClient(ServedWeights(f"{uploads}/a.weights", 2), uploads)  # connected while a client's file
    assert control.weights_shown(f"{uploads}/a.weights") == "a file a client sent (RepositoryModelLoad)"
    control.served = ServedWeights("/srv/resnet18.pt", 3)  # then --weights again (SIGHUP, or a load with no file)
    assert control.weights_shown(f"{uploads}/a.weights") == "/srv/resnet18.pt"
    control = SupervisorClient(ServedWeights("imagenet", 1), uploads)
    assert control.weights_shown("imagenet:IMAGENET1K_V1") == "imagenet:IMAGENET1K_V1"


def parallel_kernels(folder: Path) -> list[list[str]]:
    """For each graph inductor compiled into ``folder`` (a Python module of C++ kernels): its OpenMP regions'
    pragmas."""
    graphs = (path.read_text() for path in folder.rglob("*.py"))
    return [re.findall(r"#pragma omp parallel.*", graph) for graph in graphs if "cpp_fused" in graph]


def served_after_a_reload(versions, *flags: str) -> tuple[str, float]:
    """A one-front-end server started on the first weights with ``flags``, sent the second: the version then
    answered, and how far its probabilities are from the second weights' reference."""
    (first, _), (second, second_reference) = versions["first"], versions["second"]
    workers = Workers(str(first), "--model-control", "explicit", "--frontends", "1", *flags)
    try:
        port, _ = workers.serving(1)
        triton = tc.InferenceServerClient(f"127.0.0.1:{port}")
        triton.load_model("resnet18", files={"file:1/second.pt": second.read_bytes()})
        version, probabilities = infer(triton)
        return version, float(np.abs(probabilities - expected(second_reference)).max())
    finally:
        workers.close()


@pytest.mark.slow
def test_a_compiled_reload_runs_its_cpu_kernels_with_the_workers_threads(versions, tmp_path):
    """The new runner of a --compile reload is compiled on the engine's background thread, which computes with one
    torch thread; its kernels still run with the replica's --torch-threads, as the first runner's do, and it
    serves the new weights."""
    cache = tmp_path / "cache"
    version, off = served_after_a_reload(versions, "--compile", "--compile-cache", str(cache), "--torch-threads", "2",
                                         "--max-batch-size", "1")
    assert version == "2" and off < 1e-4
    graphs = parallel_kernels(cache)
    assert len(graphs) >= 2  # the first runner's and the reload's
    assert all(pragmas and set(pragmas) == {"#pragma omp parallel num_threads(2)"} for pragmas in graphs)


@pytest.mark.slow
def test_an_onnxruntime_engine_reloads_into_a_new_export_and_serves_it(versions, tmp_path):
    """ONNX Runtime's graph holds its weights: a reload exports the new ones and runs them in a new session."""
    pytest.importorskip("onnxruntime")
    cache = tmp_path / "onnx"
    version, off = served_after_a_reload(versions, "--runtime", "onnxruntime", "--compile-cache", str(cache),
                                         "--max-batch-size", "2")
    assert version == "2" and off < 1e-5
    assert len(list(cache.glob("resnet18-*.onnx"))) == 2  # the first weights' export and the second's
