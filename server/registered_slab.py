"""A GPU engine uploads its images from where the front-ends wrote them: the slab registered with CUDA.

Registered (``cudaHostRegister``: page-locked, as pinned memory is), the slab's slots are sources the GPU's copy
engines read directly, so a batch's images are copied from their slots into the device batch, one DMA an image,
queued in one call. Unregistered, the engine's one host thread first copies every image into a pinned buffer
and uploads that: on the H100, with 5.6 ms of host time a batch of 108 uint8 images (16 MB), and many times that
for FP32 inputs (76 MB a batch), in which the engine forms no other batch.

Where CUDA cannot register the memory (a container's locked-memory limit, say), or a copy from it does not give
what the host wrote, the engine says so in its log and keeps the host copy.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .preprocess import SlotBytes, copy_slots
from .slab import FREE, Slab

log = logging.getLogger("server.registered_slab")
CUDA_HOST_REGISTER_DEFAULT = 0
_CHECK_BYTES = 4096


def register_slab(slab: Slab, device: torch.device) -> bool:
    """Register the slab's memory with CUDA and check an upload from it; False (and a warning) where either fails."""
    registered = False
    try:
        with torch.cuda.device(device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(
                slab.address, slab.layout.size, CUDA_HOST_REGISTER_DEFAULT))
            registered = True
        _check_uploads_what_the_host_wrote(slab, device)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the host copy, which always works
        if registered:  # torch would see the slots as pinned and upload from them (preprocess._stack_bytes)
            torch.cuda.cudart().cudaHostUnregister(slab.address)
        log.warning("%s cannot upload from the slab where it lies (%s: %s); images are copied on the host first",
                    device, type(exc).__name__, exc)
        return False
    log.info("%s uploads images from the slab where the front-ends wrote them (%d MiB registered)", device,
             slab.layout.size >> 20)
    return True


def _check_uploads_what_the_host_wrote(slab: Slab, device: torch.device) -> None:
    """Write a pattern into a free slot (no front-end holds it, and none can take it before the engine listens)
    and upload it as a batch's images are (``preprocess.copy_slots``)."""
    rows = slab.input_rows()
    free = np.flatnonzero(slab.owners == FREE)
    if not len(free):
        raise RuntimeError("no free slot to check with")
    slot = int(free[-1])
    pattern = np.random.default_rng().integers(0, 256, _CHECK_BYTES, dtype=np.uint8)
    rows[slot, :_CHECK_BYTES] = pattern
    source = torch.from_numpy(rows)
    if not source.is_pinned():
        raise RuntimeError("torch does not see the registered slab as pinned memory")
    uploaded = copy_slots([SlotBytes(source, slot, _CHECK_BYTES)],
                          torch.empty((1, _CHECK_BYTES), dtype=torch.uint8, device=device))
    if not np.array_equal(uploaded[0].cpu().numpy(), pattern):
        raise RuntimeError("the device received other bytes than the host wrote")
