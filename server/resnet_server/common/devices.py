"""Resolve ``--device`` values to torch devices, failing clearly on unknown or absent ones."""

from __future__ import annotations

from pathlib import Path

import torch

from resnet_server.common.errors import StartupError


def resolve_devices(specs: tuple[str, ...]) -> list[torch.device]:
    """One torch device per replica. ``auto`` means every visible GPU, else the CPU."""
    devices: list[torch.device] = []
    for spec in specs:
        devices.extend(_auto_devices() if spec == "auto" else [_parse_device(spec)])
    return devices


def _auto_devices() -> list[torch.device]:
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]


def _parse_device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise StartupError(f"unknown device {spec!r}: use cpu, cuda, cuda:N, auto, or a comma-separated list") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise StartupError(f"unsupported device {spec!r}: use cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise StartupError(f"device {spec!r} requested but CUDA is not available on this machine")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise StartupError(f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return torch.device("cuda", index)


def replica_names(devices: list[torch.device]) -> list[str]:
    """Metric label per replica: the device, suffixed #i where one device holds several replicas."""
    names = [str(device) for device in devices]
    return [f"{name}#{names[:i].count(name)}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. From the CPU to a GPU it goes through pinned memory with a non_blocking copy
    on the current stream: a copy from pageable memory would synchronise the host."""
    if tensor.device == device:
        return tensor
    staged = tensor if tensor.is_pinned() else tensor.pin_memory()
    return staged.to(device, non_blocking=True)


# CPU flags (Linux /proc/cpuinfo) of units that compute bf16 convolutions natively, with what each was measured
# to give ResNet18 over fp32 in process at batch 8 (docs/performance.md, bf16 on the CPU), best first.
BF16_UNITS = {
    "amx_bf16": "AMX (amx_bf16): --precision bf16 runs the model about 3x faster than fp32",
    "avx512_bf16": "AVX-512 BF16 (avx512_bf16): --precision bf16 runs the model about 1.8x faster than fp32",
}


def cpu_bf16_unit(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """What this CPU has for bf16 (one of BF16_UNITS' descriptions), or None: AMX tiles on Xeons from
    Sapphire Rapids on, AVX-512 BF16 on AMD Zen 4 and Intel Cooper Lake; oneDNN uses either for bf16."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    flags = {flag for line in lines if line.startswith("flags") for flag in line.split()}
    return next((unit for flag, unit in BF16_UNITS.items() if flag in flags), None)
