"""--runtime onnxruntime: the served weights exported to ONNX and run by ONNX Runtime, answering as torchvision does,
through both APIs, reloads included; and the flags it goes with."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tc

from resnet_client import Client
from resnet_server import __version__
from resnet_server.common.config import ConfigError, parse_config
from tests.helpers import random_rgb, small_onnx_model

pytest.importorskip("onnxruntime")
PIXELS = [random_rgb(seed) for seed in (91, 92, 93)]


def test_onnxruntime_answers_as_the_torchvision_reference_and_names_itself(make_server, reference, weights_file,
                                                                          tmp_path):
    cache = tmp_path / "onnx"
    running = make_server(runtime="onnxruntime", compile_cache=str(cache), max_batch_size=4)
    info = running.app.engines[0].info
    assert info.runs.startswith("cpu runs fp32 on ONNX Runtime ") and "CPUExecutionProvider" in info.runs
    assert info.runs.endswith("threads) at batch sizes 1, 2, 3, 4")
    (export,) = cache.glob("resnet18-*.onnx")
    with Client(running.target) as client:
        results = client.classify(PIXELS, full=True, logits=True)
        model_info = client.model_info()
    assert model_info.runtime == "onnxruntime" and list(model_info.runs) == [info.runs]
    for result, pixels in zip(results, PIXELS, strict=True):
        model_input = reference.input_from_array(pixels)
        want = reference.logits(model_input.unsqueeze(0))[0].numpy()
        np.testing.assert_allclose(result.logits, want, atol=1e-4 * np.abs(want).max(), rtol=0)
        np.testing.assert_allclose(result.probabilities, reference.probabilities(model_input), atol=1e-5, rtol=0)
    triton = tc.InferenceServerClient(running.target)
    config = triton.get_model_config("resnet18").config
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert triton.get_model_metadata("resnet18_uint8").platform == "onnxruntime_onnx"
    assert running.sample("resnet_model_info", device="cpu", model="resnet18", version="1", runtime="onnxruntime",
                          weights=str(weights_file[0]), server_version=__version__) == 1
    exported_at = export.stat().st_mtime_ns
    again = make_server(runtime="onnxruntime", compile_cache=str(cache), max_batch_size=4)  # the same weights
    assert again.app.engines[0].info.runs.startswith("cpu runs fp32 on ONNX Runtime ")
    assert list(cache.glob("resnet18-*.onnx")) == [export] and export.stat().st_mtime_ns == exported_at


@pytest.mark.parametrize(("flags", "error"), [
    (["--precision", "bf16"], "--runtime onnxruntime serves fp32 or int8, not --precision bf16"),
    (["--compile"], "--runtime onnxruntime and --compile exclude each other: choose one"),
    (["--torchscript"], "--runtime onnxruntime and --torchscript exclude each other: choose one"),
    (["--device", "cuda:0"], "--runtime onnxruntime runs on the CPU: serve --device cpu, or run torch on a GPU"),
])
def test_onnxruntime_refuses_what_it_cannot_serve(flags, error):
    with pytest.raises(ConfigError) as caught:
        parse_config(["--runtime", "onnxruntime", *flags], env={})
    assert str(caught.value) == error


@pytest.mark.parametrize(("flag", "value", "default", "choices"), [
    ("runtime", "onnxruntime", "torch", "torch or onnxruntime"),
    ("onnx-provider", "openvino", "auto", "auto, cpu or openvino"),
])
def test_each_flag_has_an_env_twin_and_a_bad_value_is_a_usage_error(capsys, flag, value, default, choices):
    field = flag.replace("-", "_")
    assert getattr(parse_config([], env={f"RESNET_SERVER_{field.upper()}": value}), field) == value
    assert getattr(parse_config([], env={}), field) == default
    with pytest.raises(SystemExit) as exited:
        parse_config([f"--{flag}", "tensorrt"], env={})
    assert exited.value.code == 2
    assert f"argument --{flag}: must be {choices}, got 'tensorrt'" in capsys.readouterr().err


def test_openvino_asked_of_an_onnx_runtime_without_it_runs_on_the_cpu_provider_and_says_why(tmp_path, caplog):
    """Plain onnxruntime (the server extra's) has no OpenVINO execution provider: asked for it, the session runs on
    the CPU provider, a warning names what this ONNX Runtime has, and auto chooses the CPU provider at once."""
    import onnxruntime
    import torch

    from resnet_server.engine.onnx_runtime import CPU, OPENVINO, OnnxNetwork, chosen_provider

    if OPENVINO in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime is the OpenVINO build")
    model = small_onnx_model(tmp_path / "small.onnx")
    network = OnnxNetwork(model, threads=1, provider="openvino")
    assert network.provider == CPU and network.describe().endswith(f"({CPU}, 1 thread)")
    assert f"has no {OPENVINO} (it has" in caplog.text and f"running on {CPU} instead" in caplog.text
    assert chosen_provider("auto") == CPU and chosen_provider("cpu") == CPU
    assert network(torch.zeros(2, 3, 224, 224)).shape == (2, 4 * 28 * 28)
