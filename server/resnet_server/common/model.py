"""Build ResNet18, load its weights, and place it on a device.

Weights come from torchvision's ImageNet checkpoint (cached under ``TORCH_HOME``), from a
file (a plain ``state_dict``, a checkpoint dict holding one under ``state_dict`` or ``model``,
or ``nn.DataParallel`` keys prefixed ``module.``), or from a seeded random initialisation.
Files are read with ``weights_only=True`` (no pickle code runs) and ``map_location`` onto the
serving device, so a checkpoint saved on any GPU loads anywhere; a safetensors file (told by its header, not
its name) is read with the safetensors library. Every weights' identity is a SHA-256: of the file, or of the
tensors for ImageNet's and the random ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchvision.models import ResNet, ResNet18_Weights, resnet18

from resnet_server.common.errors import StartupError

log = logging.getLogger(__name__)

MODEL_NAME = "resnet18"
MODEL_VERSION = "1"
IMAGENET_WEIGHTS = ResNet18_Weights.IMAGENET1K_V1
RANDOM_SEED = 0
RANDOM_WARNING = (
    "serving RANDOM weights (--weights random): predictions are meaningless; "
    "use --weights imagenet or --weights PATH for a trained model"
)


class WeightsError(StartupError):
    """The weights cannot be loaded; the message says what to do about it."""


@dataclass(frozen=True)
class LoadedWeights:
    state_dict: Mapping[str, torch.Tensor]
    source: str  # what GetModelInfo reports, e.g. "imagenet" or the file path
    warning: str = ""
    sha256: str = ""  # the file's, or the tensors' (weights_sha256)

    def without_tensors(self) -> LoadedWeights:
        """What is kept of the weights once a model is built from them: where they came from and what they are
        (the tensors themselves, a second copy of the model's, would only take memory)."""
        return dataclasses.replace(self, state_dict={})


def load_weights(spec: str, device: torch.device) -> LoadedWeights:
    """Resolve ``--weights`` (imagenet, random or a path) to a state_dict on ``device``."""
    if spec == "imagenet":
        state = _imagenet_state_dict(device)
        return LoadedWeights(state, "imagenet:" + IMAGENET_WEIGHTS.name, sha256=tensors_sha256(state))
    if spec == "random":
        state = random_state_dict()
        return LoadedWeights(state, f"random(seed={RANDOM_SEED})", RANDOM_WARNING, tensors_sha256(state))
    return LoadedWeights(load_state_dict_file(Path(spec), device), str(spec), sha256=file_sha256(Path(spec)))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tensors_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """Of each tensor's name and bytes, in name order (a state_dict has no file of its own to hash)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def random_state_dict(seed: int = RANDOM_SEED) -> dict[str, torch.Tensor]:
    """A reproducible, untrained ResNet18 (for tests and smoke runs)."""
    torch.manual_seed(seed)
    return resnet18(weights=None).state_dict()


def _imagenet_state_dict(device: torch.device) -> Mapping[str, torch.Tensor]:
    try:
        return IMAGENET_WEIGHTS.get_state_dict(progress=False, map_location=device, weights_only=True)
    except Exception as exc:  # URLError, HTTPError, socket errors: all mean "not available"
        cache = Path(torch.hub.get_dir()) / "checkpoints" / Path(IMAGENET_WEIGHTS.url).name
        raise WeightsError(
            f"cannot get ImageNet weights ({type(exc).__name__}: {exc}); they are not cached at {cache} "
            f"and could not be downloaded. Place the file there (TORCH_HOME sets the cache), "
            f"or start with --weights PATH (a ResNet18 state_dict) or --weights random"
        ) from exc


def load_state_dict_file(path: Path, device: torch.device, mapped: bool = False) -> dict[str, torch.Tensor]:
    """Read a checkpoint file safely and return a clean ResNet18 state_dict (``mapped``: its tensors' data mapped
    from the file, read only when touched, where the file is torch.save's zip archive)."""
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist (use imagenet, random or a file path)")
    if _is_safetensors(path):
        return _load_safetensors(path, device)
    try:
        loaded = torch.load(path, map_location=device, weights_only=True, mmap=mapped and zipfile.is_zipfile(path))
    except Exception as exc:  # pickle.UnpicklingError for code-carrying files, zip errors, ...
        raise WeightsError(
            f"cannot load {path} with weights_only=True ({type(exc).__name__}): only plain tensors "
            f"and dicts are accepted, never pickled code. Save it with torch.save(model.state_dict(), path)"
        ) from exc
    return _unwrap_state_dict(loaded, path)


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and then the header, a JSON
    object; a torch.save file is a zip archive (PK) or, in the legacy format, a pickle."""
    with path.open("rb") as file:
        start = file.read(9)
    return len(start) == 9 and start[8:9] == b"{"


def _load_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"cannot load {path} as safetensors ({type(exc).__name__}: {exc})") from exc


def check_weights_file(path: Path) -> None:
    """Read the file as the engines will and check it is a ResNet18 state_dict (on no device: the shapes only
    are compared; its SHA-256 is each engine's to take as it loads it). WeightsError names what is wrong, the
    first wrong key first of all."""
    with torch.device("meta"):
        model = resnet18(weights=None)
    check_state_dict(model, _shapes(path), path.name)


def _shapes(path: Path) -> Mapping[str, torch.Tensor]:
    """The file's tensors, their data left unread where the format allows (what checking them needs): safetensors'
    header, or torch.load's zip archive mapped rather than read."""
    if not _is_safetensors(path):
        return load_state_dict_file(path, torch.device("cpu"), mapped=True)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as file:
            return {key: _described(file.get_slice(key)) for key in file.keys()}  # noqa: SIM118 - safe_open is no dict
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"cannot load {path} as safetensors ({type(exc).__name__}: {exc})") from exc


def _unwrap_state_dict(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(loaded, dict):
        for key in ("state_dict", "model"):
            if isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsError(f"{path} holds no state_dict (a dict of tensors, or one under 'state_dict' or 'model')")
    # nn.DataParallel / DistributedDataParallel prefix every key with "module.".
    if loaded and all(key.startswith("module.") for key in loaded):
        loaded = {key.removeprefix("module."): value for key, value in loaded.items()}
    return loaded


def _described(tensor_slice: Any) -> torch.Tensor:
    """A tensor of the file's shape and kind of values (floating point or not), holding nothing."""
    floating = tensor_slice.get_dtype() in ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
    return torch.empty(tensor_slice.get_shape(), dtype=torch.float32 if floating else torch.int64, device="meta")


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Name the first missing, unexpected or mis-shaped key, instead of torch's wall of text."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in state_dict:
            raise WeightsError(f"weights {source}: missing key {key!r} (is this a ResNet18 state_dict?)")
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise WeightsError(
                f"weights {source}: {key!r} has shape {tuple(state_dict[key].shape)}, "
                f"ResNet18 needs {tuple(tensor.shape)}"
            )
        if state_dict[key].is_floating_point() != tensor.is_floating_point():
            raise WeightsError(f"weights {source}: {key!r} holds {state_dict[key].dtype}, ResNet18 needs "
                               f"{'floating-point' if tensor.is_floating_point() else 'integer'} values")
    unexpected = [key for key in state_dict if key not in expected]
    if unexpected:
        raise WeightsError(f"weights {source}: unexpected key {unexpected[0]!r} (is this a ResNet18 state_dict?)")


def _check_finite(state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Weights holding NaN or infinity would answer every image with NaN, silently: refused instead."""
    for key, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightsError(f"weights {source}: {key!r} holds NaN or infinite values")


def build_model(weights: LoadedWeights, device: torch.device) -> ResNet:
    """ResNet18 in eval mode on ``device`` with the given weights: built on no device and given the weights'
    own tensors, so that no random initialisation runs and no second copy is made."""
    with torch.device("meta"):
        model = resnet18(weights=None)
    check_state_dict(model, weights.state_dict, weights.source)
    _check_finite(weights.state_dict, weights.source)
    model.load_state_dict(weights.state_dict, assign=True)
    return model.eval().to(device)
