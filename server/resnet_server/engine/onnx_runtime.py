"""ONNX Runtime as the forward pass (``--runtime onnxruntime``): the served model, batch norms folded, exported to
ONNX and run by an InferenceSession on the CPU execution provider, with as many intra-op threads as the replica's
torch team. Imported only when that runtime is asked for.

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
from resnet_server.common.preprocess import FLOAT_SHAPE

log = logging.getLogger(__name__)

PROVIDER = "CPUExecutionProvider"
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


class OnnxNetwork:
    """Logits [B, 1000] of a float32 NCHW batch [B, 3, 224, 224], computed by ONNX Runtime."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(str(path), options, providers=[PROVIDER])
        self.path, self.threads = path, threads
        self.version = onnxruntime.__version__

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        batch = np.ascontiguousarray(inputs.numpy(), dtype=np.float32)
        (logits,) = self.session.run([OUTPUT], {INPUT: batch})
        return torch.from_numpy(logits)

    def describe(self) -> str:
        return f"on ONNX Runtime {self.version} ({PROVIDER}, {self.threads} threads)"

    def unlike_resnet18(self) -> str | None:
        """What in the model's inputs or outputs differs from ResNet18's, or None."""
        def described(tensors) -> list[onnx_file.Tensor]:  # ONNX Runtime's types read "tensor(float)"
            return [(tensor.type.removeprefix("tensor(").removesuffix(")"), tensor.shape) for tensor in tensors]

        return onnx_file.unlike_resnet18(described(self.session.get_inputs()), described(self.session.get_outputs()))

    def recorded(self) -> dict[str, str]:
        """What the model file records of itself (a quantized one: its source's and calibration's SHA-256)."""
        return dict(self.session.get_modelmeta().custom_metadata_map)
