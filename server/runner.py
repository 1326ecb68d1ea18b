"""The forward pass on one device: the only code that touches the model after start-up.

On CUDA it uses pinned host staging, ``non_blocking`` copies both ways on a stream of its own,
optional reduced precision and ``channels_last``, and exactly one synchronisation per batch (when
the results land in pinned CPU memory). On the CPU it is a plain forward pass.
"""

from __future__ import annotations

import torch

from .postprocess import temperature_softmax
from .preprocess import FLOAT_SHAPE

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str = "fp32",
                 channels_last: bool = False) -> None:
        self.device = device
        self.dtype = PRECISIONS[precision]
        self.cuda = device.type == "cuda"
        self.memory_format = torch.channels_last if channels_last and self.cuda else torch.contiguous_format
        self.model = model.to(device=device, dtype=self.dtype, memory_format=self.memory_format).eval()
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @torch.inference_mode()
    def __call__(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, 3, 224, 224] and temperatures [B] on the CPU -> (probabilities, logits) on the CPU."""
        if not self.cuda:
            return self._forward(inputs, temperatures)
        with torch.cuda.stream(self.stream):
            on_device = inputs.pin_memory().to(self.device, non_blocking=True)
            temperatures_on_device = temperatures.pin_memory().to(self.device, non_blocking=True)
            probabilities, logits = self._forward(on_device, temperatures_on_device)
            both = torch.stack([probabilities, logits])
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
        self.stream.synchronize()  # the one synchronisation of the batch
        return host[0], host[1]

    def _forward(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(dtype=self.dtype).contiguous(memory_format=self.memory_format)
        logits = self.model(inputs).float()
        probabilities = temperature_softmax(logits, temperatures)
        if not self.cuda:
            # On the CPU this is already host memory: one stack, no copy.
            both = torch.stack([probabilities, logits])
            return both[0], both[1]
        return probabilities, logits

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Run every batch size once, so autotuning (cudnn.benchmark) is paid before SERVING."""
        for size in batch_sizes:
            self(torch.zeros((size, *FLOAT_SHAPE)), torch.ones(size))

    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes on the device; (0, 0) off CUDA."""
        if not self.cuda:
            return 0, 0
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)


def warm_up_sizes(max_batch_size: int, cuda: bool) -> list[int]:
    """Powers of two up to the maximum on CUDA (every size cudnn will see often); 1 and max elsewhere."""
    if not cuda:
        return sorted({1, max_batch_size})
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]
