"""int8: `resnet-server quantize` writes a QDQ model of the served weights with its evidence, and
`--runtime onnxruntime --precision int8` serves it; the flags that go with it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from resnet_client import Client
from resnet_server.common.config import HOW_TO_QUANTIZE, ConfigError, parse_config
from tests.helpers import HealthProbe, encode, random_rgb
from tests.server_process import Workers

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
PIXELS = [random_rgb(seed) for seed in (61, 62)]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized(weights_file, tmp_path_factory) -> tuple[Path, dict, list[Path]]:
    """The test weights quantized on 12 random images, 4 of them held out: the model, its report, the held-out."""
    folder = tmp_path_factory.mktemp("calibration")
    images = []
    for index in range(12):
        images.append(folder / f"image{index:02d}.jpg")
        images[-1].write_bytes(encode(random_rgb(300 + index, 200, 260)))
    out = tmp_path_factory.mktemp("int8") / "resnet18.int8.onnx"
    done = subprocess.run([sys.executable, "-m", "resnet_server", "quantize", "--weights", str(weights_file[0]),
                           "--calibration", str(folder), "--out", str(out), "--held-out", "4",
                           "--min-agreement", "0"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert json.loads(done.stdout) == report
    return out, report, images[-4:]


def session_probabilities(model: Path, inputs: torch.Tensor) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": inputs.numpy()})
    return torch.softmax(torch.from_numpy(logits).double(), dim=1).numpy()


def test_the_report_says_how_the_int8_model_agrees_with_fp32_and_the_model_records_its_sources(
        quantized, weights_file, reference):
    out, report, held_out = quantized
    inputs = torch.stack([reference.input_from_bytes(path.read_bytes()) for path in held_out])
    fp32 = torch.softmax(reference.logits(inputs).double(), dim=1).numpy()
    int8 = session_probabilities(out, inputs)
    assert report["calibration_images"] == 8 and report["held_out_images"] == 4 and report["written"] is True
    assert report["top1_agreement"] == pytest.approx(float(np.mean(fp32.argmax(1) == int8.argmax(1))))
    assert report["max_probability_difference"] == pytest.approx(float(np.abs(fp32 - int8).max()), abs=1e-5)
    assert report["weights_sha256"] == hashlib.sha256(weights_file[0].read_bytes()).hexdigest()
    recorded = {entry.key: entry.value for entry in onnx.load(str(out)).metadata_props}
    assert recorded["resnet_source_sha256"] == report["weights_sha256"]
    assert recorded["resnet_calibration_sha256"] == report["calibration_sha256"]
    assert recorded["resnet_precision"] == "int8"
    assert any(node.op_type == "QuantizeLinear" for node in onnx.load(str(out)).graph.node)


def test_a_model_under_the_least_agreement_is_not_written(weights_file, quantized, tmp_path):
    from resnet_server.engine.quantize import quantize

    _, _, held_out = quantized
    calibration = sorted(held_out[0].parent.glob("*.jpg"))[:8]
    out = tmp_path / "refused.onnx"
    report = quantize(str(weights_file[0]), calibration, held_out, out, min_agreement=1.01, temperature=1.0)
    assert report["written"] is False and not out.exists()
    assert json.loads((tmp_path / "refused.onnx.report.json").read_text()) == report


def test_a_blank_calibration_makes_a_model_that_disagrees_and_quantize_refuses_to_write_it(weights_file, quantized,
                                                                                            tmp_path):
    """Ranges calibrated on one black image fit no real image: at the default --min-agreement (0.99) the command
    exits 1 naming the agreement it found, writes the report and not the model."""
    from PIL import Image

    _, _, held_out = quantized
    folder = tmp_path / "calibration"
    folder.mkdir()
    Image.new("RGB", (224, 224)).save(folder / "blank.png")
    for path in held_out:
        (folder / f"zz-{path.name}").write_bytes(path.read_bytes())  # sorted last: the held-out images
    out = tmp_path / "blank.int8.onnx"
    done = subprocess.run([sys.executable, "-m", "resnet_server", "quantize", "--weights", str(weights_file[0]),
                           "--calibration", str(folder), "--out", str(out), "--held-out", str(len(held_out))],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert done.returncode == 1 and not out.exists(), done.stderr
    assert report["calibration_images"] == 1 and report["written"] is False and report["top1_agreement"] < 0.99
    assert f"top-1 agreement {report['top1_agreement']:.4f} on 4 held-out images is under --min-agreement 0.99" \
        in done.stderr


def test_the_int8_model_is_served_with_its_answers_and_names_what_it_is(make_server, quantized, reference):
    out, _, _ = quantized
    running = make_server(runtime="onnxruntime", precision="int8", weights=str(out), max_batch_size=2)
    assert running.app.engines[0].info.runs.startswith("cpu runs int8 on ONNX Runtime ")
    with Client(running.target) as client:
        results = client.classify(PIXELS, full=True)
    inputs = torch.stack([reference.input_from_array(pixels) for pixels in PIXELS])
    want = session_probabilities(out, inputs)
    for result, expected in zip(results, want, strict=True):
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


def test_a_client_sends_an_int8_model_with_repository_model_load_and_a_wrong_one_is_refused(quantized, tmp_path):
    """Serving an int8 ONNX model with --model-control explicit: the same model sent as a file is served as version
    2; an ONNX file whose input is not ResNet18's, an fp32 model, and a state_dict are each refused
    INVALID_ARGUMENT naming the file as sent and what differs, and version 2 serves on."""
    out, _, _ = quantized
    workers = Workers(str(out), "--model-control", "explicit", "--runtime", "onnxruntime", "--precision", "int8",
                      "--frontends", "1", env={"TMPDIR": str(tmp_path)})  # its folder of files sent: the test's
    try:
        port, _ = workers.serving(1)
        sent_and_refused(f"127.0.0.1:{port}", out, tmp_path)
    finally:
        workers.close()


def sent_and_refused(target: str, out: Path, tmp_path: Path) -> None:
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    triton = tc.InferenceServerClient(target)
    triton.load_model("resnet18", files={"file:1/model.onnx": out.read_bytes()})
    foreign = tmp_path / "linear.onnx"
    torch.onnx.export(torch.nn.Linear(10, 1000), (torch.zeros(1, 10),), str(foreign), dynamo=False,
                      input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "n"}})
    fp32 = onnx.load(str(out))
    next(entry for entry in fp32.metadata_props if entry.key == "resnet_precision").value = "fp32"
    refusals = {}
    for name, data in (("linear.onnx", foreign.read_bytes()), ("fp32.onnx", fp32.SerializeToString()),
                       ("weights.pt", b"PK\x03\x04 not a model")):
        with pytest.raises(InferenceServerException) as caught:
            triton.load_model("resnet18", files={f"file:1/{name}": data})
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        refusals[name] = caught.value.message()
    assert "1/linear.onnx: not a ResNet18 model: its input is float ['n', 10], not float [N, 3, 224, 224]" in \
        refusals["linear.onnx"]
    assert "1/fp32.onnx: an fp32 model, served as --precision int8" in refusals["fp32.onnx"]
    assert "1/weights.pt: not an ONNX model" in refusals["weights.pt"]
    worst_values_refused_in_short_while_health_answers(triton, target, out)
    with Client(target) as client:
        info = client.model_info()
        assert info.weights_version == 2 and info.weights_sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
        assert len(client.classify([encode(PIXELS[0])])) == 1


def worst_values_refused_in_short_while_health_answers(triton, target: str, out: Path) -> None:
    """Within --max-weights-mb (50): a precision of 30 MiB in the model's metadata, and an input of a type no ONNX
    type has with a dimension named in 8 MiB; each refused naming at most 64 characters of the client's text,
    while health on the same front-end answers within a second."""
    from tritonclient.utils import InferenceServerException

    long_precision = onnx.load(str(out))
    next(entry for entry in long_precision.metadata_props if entry.key == "resnet_precision").value = "p" * (30 << 20)
    odd_input = onnx.ModelProto(ir_version=8, graph=onnx.GraphProto(name="odd"))
    odd_input.opset_import.add(version=17)
    tensor = odd_input.graph.input.add(name="input").type.tensor_type
    tensor.elem_type = 999
    tensor.shape.dim.add(dim_param="n" * (8 << 20))
    probe = HealthProbe(target)
    try:
        refusals = {}
        for name, model in (("precision", long_precision), ("input", odd_input)):
            with pytest.raises(InferenceServerException) as caught:
                triton.load_model("resnet18", files={f"file:1/{name}.onnx": model.SerializeToString()})
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            refusals[name] = caught.value.message()
    finally:
        probe.stop()
    assert f"1/precision.onnx: an {'p' * 64} model, served as --precision int8" in refusals["precision"]
    assert f"1/input.onnx: not a ResNet18 model: its input is type 999 ['{'n' * 64}'], not float [N, 3, 224, 224]" \
        in refusals["input"]
    assert all(len(message) < 400 for message in refusals.values()), refusals
    assert probe.times and max(probe.times) < 1.0, max(probe.times)


def test_int8_without_a_quantized_model_is_a_usage_error_saying_how_to_make_one(quantized, weights_file):
    with pytest.raises(ConfigError) as caught:
        parse_config(["--precision", "int8", "--runtime", "onnxruntime", "--weights", str(weights_file[0])], env={})
    assert str(caught.value) == \
        f"--precision int8 serves an int8 ONNX model with --runtime onnxruntime: {HOW_TO_QUANTIZE}"
    with pytest.raises(ConfigError, match="an ONNX file is served with --runtime onnxruntime"):
        parse_config(["--weights", str(quantized[0])], env={})


def test_bench_model_times_the_int8_model_in_process_and_refuses_int8_without_one(quantized, capsys):
    from resnet_server.cli import main

    out, _, _ = quantized
    assert main(["bench-model", "--runtime", "onnxruntime", "--precision", "int8", "--weights", str(out),
                 "--batch-sizes", "1,2", "--duration", "0.3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["runtime"], result["precision"]) == ("onnxruntime", "int8")
    assert set(result["forward_images_per_s"]) == {"1", "2"} and min(result["forward_images_per_s"].values()) > 0
    with pytest.raises(SystemExit) as exited:
        main(["bench-model", "--precision", "int8"])
    assert exited.value.code == 2 and f"--precision int8 serves an int8 ONNX model with --runtime onnxruntime: " \
        f"{HOW_TO_QUANTIZE}" in capsys.readouterr().err


def test_quantize_refuses_a_bad_least_agreement_and_a_folder_without_enough_images(tmp_path, capsys):
    from resnet_server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["quantize", "--weights", "random", "--calibration", str(tmp_path), "--out", str(tmp_path / "m.onnx"),
              "--min-agreement", "1.5"])
    assert exited.value.code == 2 and "argument --min-agreement: must be between 0 and 1, got 1.5" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["quantize", "--weights", "random", "--calibration", str(tmp_path), "--out", str(tmp_path / "m.onnx")])
    assert exited.value.code == 2 and f"--calibration {tmp_path} holds 0 images; it needs more than the 1 held out" \
        in capsys.readouterr().err


def test_an_onnx_file_that_is_not_resnet18_is_refused_naming_what_differs(tmp_path):
    foreign = tmp_path / "linear.onnx"
    torch.onnx.export(torch.nn.Linear(10, 1000), (torch.zeros(1, 10),), str(foreign), dynamo=False,
                      input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "n"}})
    done = subprocess.run([sys.executable, "-m", "resnet_server", "--runtime", "onnxruntime", "--weights",
                           str(foreign), "--device", "cpu", "--host", "127.0.0.1", "--port", "0", "--metrics-port",
                           "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"resnet-server: error: engine cpu: weights {foreign}: not a ResNet18 model: its input is float " \
        "['n', 10], not float [N, 3, 224, 224]" in done.stderr
