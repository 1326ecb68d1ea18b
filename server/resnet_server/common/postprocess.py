"""Temperature-scaled softmax and top-k, vectorised over a batch.

Each image carries its own temperature, so one batch can mix callers with different T:
``softmax(logits / T)`` row by row is exactly one division by a column vector. Rows never
interact, which is why a result cannot depend on the batch it shared.
"""

from __future__ import annotations

import torch


def temperature_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) per row; logits [B, C], temperatures [B] (float64: any finite T > 0 is valid).

    Subtracting each row's maximum first (softmax is shift-invariant) keeps every scaled logit <= 0,
    so a tiny T sends the others to -inf (probability 0) instead of overflowing to inf - inf = NaN.
    Float64 keeps T = 1e-100 from rounding to 0; it is 1000 values per image, so the cost is nil.
    """
    shifted = (logits - logits.amax(dim=1, keepdim=True)).double()
    scaled = shifted / temperatures.to(device=logits.device, dtype=torch.float64).unsqueeze(1)
    return torch.softmax(scaled, dim=1).float()


def top_k(probabilities: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """Each row's ks[row] most probable classes, most probable first, as (index, probability).

    One topk over the whole batch (at the largest k asked) and one conversion to Python numbers: a batch
    costs three torch calls rather than three per image, each of which waits for the GIL again while the
    event loop holds it (on a GPU the per-image calls took longer than the forward pass)."""
    values, indices = torch.topk(probabilities, max(ks), dim=1)
    return [list(zip(row_indices[:k], row_values[:k], strict=True))
            for row_indices, row_values, k in zip(indices.tolist(), values.tolist(), ks, strict=True)]
