"""A GPU engine reads its images where the front-ends wrote them: the slab's memory registered with CUDA.

Registered (page-locked and mapped into the device's address space, ``cudaHostRegister``), the slab's input
rows can be wrapped as a CUDA tensor over the very same memory, and a batch's images are gathered by one
kernel that reads them over PCIe, straight into the device batch. Unregistered, the engine's one host thread
copies every image into a pinned buffer first and uploads that: on the H100, 5.6 ms of host time a batch of
108 uint8 images (16 MB) and more than ten times that for a batch of FP32 inputs (76 MB), time in which the
engine forms no other batch.

Where CUDA cannot register the memory (a container's locked-memory limit, a platform without unified
addressing), or the device does not read back what the host wrote, the engine says so in its log and keeps the
host copy.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .slab import FREE, Slab

log = logging.getLogger("server.mapped_slab")
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device may address the memory
_CHECK_BYTES = 4096


class _CudaArray:
    """Memory the device can address, described by the CUDA array interface (version 3), which
    ``torch.as_tensor`` wraps without a copy."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"version": 3, "shape": shape, "strides": strides, "typestr": "|u1",
                                         "data": (address, False), "stream": None}


def device_input_rows(slab: Slab, device: torch.device) -> torch.Tensor | None:
    """The slab's input rows, uint8 [slots, inline bytes], as a tensor on ``device`` over the slab's own memory;
    None (and a warning in the log) where that cannot be had."""
    rows = slab.input_rows()
    try:
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                slab.address, slab.layout.size, CUDA_HOST_REGISTER_MAPPED))
        mapped = torch.as_tensor(_CudaArray(rows.ctypes.data, rows.shape, rows.strides), device=device)
        _check_reads_what_the_host_wrote(slab, rows, mapped)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the host copy, which always works
        log.warning("%s cannot read the slab where it lies (%s: %s); images are copied on the host first",
                    device, type(exc).__name__, exc)
        return None
    log.info("%s reads images from the slab where the front-ends wrote them (%d MiB registered)", device,
             slab.layout.size >> 20)
    return mapped


def _check_reads_what_the_host_wrote(slab: Slab, rows: np.ndarray, mapped: torch.Tensor) -> None:
    """Write a pattern into a free slot (no front-end holds it, and none can take it before the engine listens)
    and read it back through the device."""
    free = np.flatnonzero(slab.owners == FREE)
    if not len(free):
        raise RuntimeError("no free slot to check with")
    slot = int(free[-1])
    pattern = np.random.default_rng().integers(0, 256, _CHECK_BYTES, dtype=np.uint8)
    rows[slot, :_CHECK_BYTES] = pattern
    if not np.array_equal(mapped[slot, :_CHECK_BYTES].cpu().numpy(), pattern):
        raise RuntimeError("the device read other bytes than the host wrote")
