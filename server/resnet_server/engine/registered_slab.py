"""A GPU engine uploads its images from where the front-ends wrote them: the slab registered with CUDA.

Registered (``cudaHostRegister``: page-locked, as pinned memory is), the slab's slots are memory the GPU reads
directly. Best, the engine sees the slab as a CUDA tensor at the same addresses (unified addressing, which
registered memory has on 64-bit Linux) and a batch is one gather kernel that reads its images over the bus
(``device_rows``). Where that does not give what the host wrote, each image is one DMA from its slot into the
device batch, queued in one call (``preprocess.copy_slots``). Unregistered, the engine's one host thread first
copies every image into a pinned buffer and uploads that, and forms no other batch meanwhile (the figures:
docs/performance.md, "Figures behind the code").

Where CUDA cannot register the memory (a container's locked-memory limit, say), or a read from it does not give
what the host wrote, the engine says so in its log and keeps the next way down.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from resnet_server.boundary.slab import FREE, Slab
from resnet_server.common.preprocess import SlotBytes, stack_bytes

log = logging.getLogger(__name__)
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: in the device's address space too (device_rows)
_CHECK_BYTES = 4096


def register_slab(slab: Slab, device: torch.device) -> bool:
    """Register the slab's memory with CUDA and check an upload from it; False (and a warning) where either fails."""
    registered = False
    try:
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                slab.address, slab.layout.size, CUDA_HOST_REGISTER_MAPPED))
            registered = True
        _check_reads_what_the_host_wrote(slab, device, torch.from_numpy(slab.input_rows()))
    except Exception as exc:  # noqa: BLE001 - any failure leaves the host copy, which always works
        if registered:  # torch would see the slots as pinned and upload from them (preprocess.stack_bytes)
            torch.cuda.cudart().cudaHostUnregister(slab.address)
        log.warning("%s cannot upload from the slab where it lies (%s: %s); images are copied on the host first",
                    device, type(exc).__name__, exc)
        return False
    log.info("%s uploads images from the slab where the front-ends wrote them (%d MiB registered)", device,
             slab.layout.size >> 20)
    return True


def device_rows(slab: Slab, device: torch.device) -> torch.Tensor | None:
    """The registered slab's input rows as a CUDA tensor over the same memory, which a batch's images are
    gathered from in one kernel; None (and a line in the log) where the device does not read there what the
    host wrote, and images are then uploaded one copy each."""
    host_rows = slab.input_rows()
    try:
        with torch.cuda.device(device):
            rows = torch.as_tensor(_InPlace(host_rows), device=device)
        if rows.data_ptr() != host_rows.ctypes.data:
            raise RuntimeError("torch copied the slab rather than reading it in place")
        for _ in range(2):  # twice, new bytes each time: a kernel reads what the host wrote since the last one
            _check_reads_what_the_host_wrote(slab, device, rows)
    except Exception as exc:  # noqa: BLE001 - the copy an image stays, which the registration check passed
        log.info("%s uploads each image with a copy of its own (the slab as a CUDA tensor: %s: %s)", device,
                 type(exc).__name__, exc)
        return None
    log.info("%s gathers each batch's images from the slab in one kernel", device)
    return rows


class _InPlace:
    """Host rows described by ``__cuda_array_interface__`` at their own addresses: registered memory has the same
    address on the device (unified addressing), so torch wraps it as a CUDA tensor without a copy."""

    def __init__(self, rows: np.ndarray) -> None:
        self.__cuda_array_interface__ = {"shape": rows.shape, "strides": rows.strides, "typestr": "|u1",
                                         "data": (rows.ctypes.data, False), "version": 3}


def _check_reads_what_the_host_wrote(slab: Slab, device: torch.device, rows: torch.Tensor) -> None:
    """Write a pattern into a free slot (no front-end holds it, and none can take it before the engine listens)
    and read it from ``rows`` as a batch's images are (``preprocess.stack_bytes``): gathered in one kernel from
    the slab as a CUDA tensor, or one DMA from the registered host rows, which torch must see as pinned."""
    if not (rows.is_cuda or rows.is_pinned()):
        raise RuntimeError("torch does not see the registered slab as pinned memory")
    free = np.flatnonzero(slab.owners == FREE)
    if not len(free):
        raise RuntimeError("no free slot to check with")
    slot = int(free[-1])
    pattern = np.random.default_rng().integers(0, 256, _CHECK_BYTES, dtype=np.uint8)
    slab.input_rows()[slot, :_CHECK_BYTES] = pattern
    uploaded = stack_bytes([SlotBytes(rows, slot, _CHECK_BYTES)], "uint8", (_CHECK_BYTES,), device)
    if not np.array_equal(uploaded[0].cpu().numpy(), pattern):
        raise RuntimeError("the device received other bytes than the host wrote")
