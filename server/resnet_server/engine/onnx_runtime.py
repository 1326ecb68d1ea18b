"""ONNX Runtime as the forward pass (``--runtime onnxruntime``): the served model, batch norms folded, exported to
ONNX and run by an InferenceSession on the execution provider ``--onnx-provider`` chooses (the CPU's, or
OpenVINO's where the onnxruntime-openvino build is installed), with as many threads as the replica's torch team
would have. Imported only when that runtime is asked for.

An export is kept in a folder (``--compile-cache``, else one under the temp folder) named by the SHA-256 of the
exported network's tensors and the versions of torch, onnx and onnxruntime, so a restart or a replica with the same
weights loads it instead of exporting again, and changed weights or versions never load a stale one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from resnet_server.common import onnx_file
from resnet_server.common.shapes import FLOAT_SHAPE

log = logging.getLogger(__name__)

CPU, OPENVINO = "CPUExecutionProvider", "OpenVINOExecutionProvider"
PROVIDERS = {"cpu": CPU, "openvino": OPENVINO}  # --onnx-provider's names
OPSET = 17
INPUT, OUTPUT = "input", "logits"


def default_cache() -> str:
    return os.path.join(tempfile.gettempdir(), "resnet-onnx-cache")


def versions() -> str:
    import onnx
    import onnxruntime

    return f"torch {torch.__version__}, onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}"


def export_key(model: torch.nn.Module) -> str:
    """What names an export: its tensors' bytes and the versions that export and run it."""
    digest = hashlib.sha256(f"{versions()}, opset {OPSET}".encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def exported(model: torch.nn.Module, cache: str | None) -> Path:
    """The ONNX file of ``model`` (fp32 on the CPU), from the cache or exported into it now."""
    folder = Path(cache or default_cache())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"resnet18-{export_key(model)[:32]}.onnx"
    if path.exists():
        return path
    example = torch.zeros((1, *FLOAT_SHAPE))
    written = path.with_suffix(f".{os.getpid()}.tmp")  # whole or not at all: another engine may read it
    with warnings.catch_warnings():  # the TorchScript-based exporter: deprecated, and needing no onnxscript
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), str(written), dynamo=False, input_names=[INPUT],
                          output_names=[OUTPUT], dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}},
                          opset_version=OPSET)
    written.replace(path)
    log.info("exported the model to ONNX: %s", path)
    return path


def chosen_provider(asked: str) -> str:
    """The execution provider ``--onnx-provider asked`` means here: auto is OpenVINO's where the installed ONNX
    Runtime has it (the onnxruntime-openvino build), else the CPU provider."""
    import onnxruntime

    if asked == "auto":
        return OPENVINO if OPENVINO in onnxruntime.get_available_providers() else CPU
    return PROVIDERS[asked]


class OnnxNetwork:
    """Logits [B, 1000] of a float32 NCHW batch [B, 3, 224, 224], computed by ONNX Runtime on ``provider``
    (``--onnx-provider``); a provider other than the CPU's that fails to load falls back to the CPU's, with a
    warning saying why."""

    def __init__(self, path: Path, threads: int, provider: str = "cpu") -> None:
        import onnxruntime

        self.path, self.threads = path, threads
        self.version = onnxruntime.__version__
        chosen = chosen_provider(provider)
        try:
            self.session = self._session(chosen)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own errors, of a provider that would not load
            if chosen == CPU:
                raise
            log.warning("the %s execution provider failed to load %s (%s: %s); running on %s instead", chosen,
                        path.name, type(exc).__name__, str(exc)[:200], CPU)
            self.session = self._session(CPU)
        else:
            if chosen not in self.session.get_providers():  # ONNX Runtime drops a provider it lacks, unasked
                log.warning("this ONNX Runtime (%s) has no %s (it has %s); running on %s instead", self.version,
                            chosen, ", ".join(onnxruntime.get_available_providers()), CPU)
        self.provider = self.session.get_providers()[0]

    def _session(self, provider: str):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        if provider == CPU:
            return onnxruntime.InferenceSession(str(self.path), options, providers=[CPU])
        return onnxruntime.InferenceSession(str(self.path), options, providers=[provider, CPU], provider_options=[
            {"device_type": "CPU", "num_of_threads": str(self.threads)}, {}])

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        batch = np.ascontiguousarray(inputs.numpy(), dtype=np.float32)
        (logits,) = self.session.run([OUTPUT], {INPUT: batch})
        return torch.from_numpy(logits)

    def describe(self) -> str:
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"on ONNX Runtime {self.version} ({self.provider}, {threads})"

    def unlike_resnet18(self) -> str | None:
        """What in the model's inputs or outputs differs from ResNet18's, or None."""
        def described(tensors) -> list[onnx_file.Tensor]:  # ONNX Runtime's types read "tensor(float)"
            return [(tensor.type.removeprefix("tensor(").removesuffix(")"), tensor.shape) for tensor in tensors]

        return onnx_file.unlike_resnet18(described(self.session.get_inputs()), described(self.session.get_outputs()))

    def recorded(self) -> dict[str, str]:
        """What the model file records of itself (a quantized one: its source's and calibration's SHA-256)."""
        return dict(self.session.get_modelmeta().custom_metadata_map)
