"""``resnet-server quantize``: an int8 ONNX model of the served weights, with the evidence that it answers as they do.

The weights are exported as ``--runtime onnxruntime`` exports them (batch norms folded, fp32), then quantized
statically by ONNX Runtime (QDQ, int8 weights per output channel, uint8 activations) with ranges calibrated on
images run through the server's own preprocessing. Images held out of the calibration then compare the two: the
share whose top-1 class agrees, and the largest and mean difference of any probability at the served temperature.
A report with those figures is written beside the model (``FILE.report.json``); a model whose agreement is under
``--min-agreement`` is not written (the command exits 1 and the report says why). The model records its source's
SHA-256 and the calibration images', which the server logs when it serves it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from resnet_client.flags import non_negative_float, positive_int
from resnet_server.common import onnx_file
from resnet_server.common.errors import InvalidInput, StartupError
from resnet_server.common.model import build_model, load_weights
from resnet_server.common.preprocess import EncodedImage, preprocess
from resnet_server.engine import onnx_runtime
from resnet_server.engine.runner import batch_norms_folded

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp")
MOST_PIXELS = 40_000_000
BATCH = 8


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="resnet-server quantize", description=__doc__.split("\n\n")[0])
    made.add_argument("--weights", required=True, help="the served weights: imagenet, random or a state_dict file")
    made.add_argument("--calibration", required=True, type=Path,
                      help="a folder of images (jpg, png, gif, webp, bmp); a few hundred advised")
    made.add_argument("--out", required=True, type=Path, help="the int8 ONNX file to write")
    made.add_argument("--held-out", type=positive_int, default=None,
                      help="images kept out of the calibration to compare with (default: a fifth, at least one)")
    made.add_argument("--min-agreement", type=_share, default=0.99,
                      help="the least share of held-out images whose top-1 class agrees with fp32 (default 0.99)")
    made.add_argument("--temperature", type=non_negative_float, default=1.0,
                      help="the served temperature the probabilities are compared at (default 1)")
    return made


def _share(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def main(argv: Sequence[str]) -> int:
    made = parser()
    args = made.parse_args(argv)
    paths = sorted(path for path in args.calibration.iterdir() if path.suffix.lower() in IMAGE_SUFFIXES) \
        if args.calibration.is_dir() else []
    held_out = args.held_out or max(1, len(paths) // 5)
    if len(paths) <= held_out:
        made.error(f"--calibration {args.calibration} holds {len(paths)} images; it needs more than the "
                   f"{held_out} held out")
    try:
        report = quantize(args.weights, paths[:-held_out], paths[-held_out:], args.out, args.min_agreement,
                          args.temperature)
    except (StartupError, InvalidInput) as exc:
        print(f"resnet-server quantize: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    if not report["written"]:
        print(f"resnet-server quantize: error: top-1 agreement {report['top1_agreement']:.4f} on "
              f"{report['held_out_images']} held-out images is under --min-agreement {args.min_agreement}; "
              f"{args.out} is not written (more or more typical calibration images may help)", file=sys.stderr)
        return 1
    return 0


def quantize(weights: str, calibration: list[Path], held_out: list[Path], out: Path, min_agreement: float,
             temperature: float) -> dict[str, object]:
    """Quantize, compare, and write the model (if it agrees enough) and its report; the report."""
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static

    loaded = load_weights(weights, torch.device("cpu"))
    model = batch_norms_folded(build_model(loaded, torch.device("cpu")))
    calibration_inputs = _inputs(calibration)
    with tempfile.TemporaryDirectory() as folder:
        fp32 = onnx_runtime.exported(model, folder)
        prepared, int8 = Path(folder) / "prepared.onnx", Path(folder) / "int8.onnx"
        quant_pre_process(str(fp32), str(prepared))  # shapes inferred and constants folded, as ORT advises
        quantize_static(str(prepared), str(int8), _Reader(calibration_inputs), quant_format=QuantFormat.QDQ,
                        per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        compared = compare(fp32, int8, _inputs(held_out), temperature)
        report = {"weights": loaded.source, "weights_sha256": loaded.sha256, "calibration_images": len(calibration),
                  "calibration_sha256": files_sha256(calibration), "held_out_images": len(held_out),
                  "temperature": temperature, **compared, "min_agreement": min_agreement,
                  "versions": onnx_runtime.versions()}
        report["written"] = compared["top1_agreement"] >= min_agreement
        if report["written"]:
            _record(int8, out, loaded.sha256, str(report["calibration_sha256"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _inputs(paths: list[Path]) -> np.ndarray:
    """The images as the server preprocesses them: float32 [N, 3, 224, 224]."""
    rows = []
    for path in paths:
        try:
            rows.append(preprocess(EncodedImage(path.read_bytes()), MOST_PIXELS))
        except InvalidInput as exc:
            raise InvalidInput(f"{path.name}: {exc}") from None
    return torch.stack(rows).numpy()


class _Reader:
    """The calibration images, BATCH at a time, as ONNX Runtime's calibrator reads them."""

    def __init__(self, inputs: np.ndarray) -> None:
        self._batches: Iterator[np.ndarray] = iter([inputs[i:i + BATCH] for i in range(0, len(inputs), BATCH)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {onnx_runtime.INPUT: batch}


def compare(fp32: Path, int8: Path, inputs: np.ndarray, temperature: float) -> dict[str, float]:
    """Top-1 agreement, and the largest and mean absolute difference of the probabilities, int8 against fp32."""
    first = _probabilities(fp32, inputs, temperature)
    second = _probabilities(int8, inputs, temperature)
    difference = np.abs(first - second)
    return {"top1_agreement": float(np.mean(first.argmax(1) == second.argmax(1))),
            "max_probability_difference": float(difference.max()),
            "mean_probability_difference": float(difference.mean())}


def _probabilities(model: Path, inputs: np.ndarray, temperature: float) -> np.ndarray:
    network = onnx_runtime.OnnxNetwork(model, threads=torch.get_num_threads())
    logits = torch.cat([network(torch.from_numpy(inputs[i:i + BATCH])) for i in range(0, len(inputs), BATCH)])
    return torch.softmax(logits.double() / max(temperature, 1e-6), dim=1).numpy()


def files_sha256(paths: list[Path]) -> str:
    """Of the images' names and bytes, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _record(model: Path, out: Path, source_sha256: str, calibration_sha256: str) -> None:
    """The model written to ``out`` (whole or not at all), recording where it came from."""
    import onnx

    proto = onnx.load(str(model))
    for key, value in ((onnx_file.SOURCE_SHA256, source_sha256),
                       (onnx_file.CALIBRATION_SHA256, calibration_sha256), (onnx_file.PRECISION, "int8")):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    out.parent.mkdir(parents=True, exist_ok=True)
    written = out.with_name(out.name + ".tmp")
    onnx.save(proto, str(written))
    written.replace(out)
