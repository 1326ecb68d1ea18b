"""Temperature softmax and top-k maths, including extreme temperatures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resnet_server.common.postprocess import temperature_softmax, top_k


def reference_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max()
    return np.exp(scaled) / np.exp(scaled).sum()


def test_each_row_uses_its_own_temperature():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 5
    temperatures = torch.tensor([0.5, 1.0, 4.0], dtype=torch.float64)
    probabilities = temperature_softmax(logits, temperatures)
    for row, t in enumerate(temperatures.tolist()):
        np.testing.assert_allclose(probabilities[row].numpy(), reference_softmax(logits[row].numpy(), t), atol=1e-7)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-103, 1e300, 1.7e308])
def test_extreme_temperatures_stay_finite(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    probabilities = temperature_softmax(logits, torch.tensor([temperature], dtype=torch.float64))
    assert torch.isfinite(probabilities).all()
    assert probabilities.sum().item() == pytest.approx(1.0, abs=1e-6)
    if temperature < 1e-100:
        assert probabilities[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # the limit T -> 0 is the one-hot argmax
    else:
        np.testing.assert_allclose(probabilities[0].numpy(), 0.25, atol=1e-6)  # T -> inf is uniform


def test_top_k_orders_by_probability_with_each_rows_own_k():
    probabilities = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.4, 0.05, 0.3, 0.25]])
    assert top_k(probabilities, [3, 1]) == [[(1, 0.5), (3, 0.25), (2, pytest.approx(0.15))], [(0, pytest.approx(0.4))]]
