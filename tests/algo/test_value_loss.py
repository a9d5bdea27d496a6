"""value_loss (PPO clipped value loss) and explained_variance against hand computations and numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sao.algo import explained_variance, value_loss

# 3 action tokens + 1 padding token, clip 0.2:
#   t0: V=1.0, V_old=0.5, R=1.2: unclipped (1.0-1.2)^2 = 0.04; clipped V 0.7 -> (0.7-1.2)^2 = 0.25; max 0.25 (clipped)
#   t1: V=0.6, V_old=0.5, R=0.0: |V - V_old| = 0.1 <= 0.2, both 0.36                               max 0.36
#   t2: V=0.0, V_old=0.5, R=1.0: unclipped 1.0;         clipped V 0.3 -> (0.3-1.0)^2 = 0.49; max 1.0
#   loss = 0.5 * (0.25 + 0.36 + 1.0) / 3 = 0.268333...
VALUES = [[1.0, 0.6, 0.0, 5.0]]
OLD_VALUES = [[0.5, 0.5, 0.5, -5.0]]
RETURNS = [[1.2, 0.0, 1.0, 0.0]]
MASK = [[True, True, True, False]]


def test_value_loss_clipping_matches_hand_computation() -> None:
    values = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor(OLD_VALUES), torch.tensor(RETURNS), torch.tensor(MASK), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.36 + 1.0) / 3)
    loss.backward()
    # d/dV of 0.5 * (V - R)^2 / 3 where the unclipped term is the max; 0 where the clipped term won (t0) and off-mask
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.6 / 3, -1.0 / 3, 0.0]], dtype=torch.float64))
    assert metrics["value/clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["value/num_action_tokens"].item() == 3


def test_value_loss_without_clip_is_half_mean_squared_error() -> None:
    values = torch.tensor(VALUES, requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor(OLD_VALUES), torch.tensor(RETURNS), torch.tensor(MASK), clip=None)
    assert loss.item() == pytest.approx(0.5 * (0.04 + 0.36 + 1.0) / 3)
    assert metrics["value/clipfrac"].item() == 0.0


def test_value_loss_normalizer_override_and_empty_mask() -> None:
    args = (torch.tensor(VALUES), torch.tensor(OLD_VALUES), torch.tensor(RETURNS))
    loss, _ = value_loss(*args, torch.tensor(MASK), clip=0.2, num_action_tokens=6)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.36 + 1.0) / 6)
    values = torch.tensor(VALUES, requires_grad=True)
    loss, metrics = value_loss(values, *args[1:], torch.zeros(1, 4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and (values.grad == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_value_loss_gradient_flows_only_through_values() -> None:
    old = torch.tensor(OLD_VALUES, requires_grad=True)
    returns = torch.tensor(RETURNS, requires_grad=True)
    values = torch.tensor(VALUES, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = value_loss(values, old, returns, torch.tensor(MASK))
    assert loss.dtype == torch.float32
    loss.backward()
    assert old.grad is None and returns.grad is None and values.grad is not None


def test_value_loss_rejects_bad_clip() -> None:
    t = torch.tensor(VALUES)
    with pytest.raises(ValueError, match="clip=0.0 must be > 0, or None"):
        value_loss(t, t, t, torch.tensor(MASK), clip=0.0)


def test_explained_variance_matches_numpy_on_masked_entries() -> None:
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(4, 50, generator=g, dtype=torch.float64)
    pred = returns + 0.5 * torch.randn(4, 50, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 50, generator=g) < 0.6
    y, p = returns[mask].numpy(), pred[mask].numpy()
    expected = 1 - np.var(y - p) / np.var(y)
    assert explained_variance(pred, returns, mask).item() == pytest.approx(expected, rel=1e-10)
    _, metrics = value_loss(pred, pred, returns, mask)
    assert metrics["value/explained_variance"].item() == pytest.approx(expected, rel=1e-10)


def test_explained_variance_is_finite_on_degenerate_inputs() -> None:
    mask = torch.tensor([[True, True, False]])
    constant = torch.tensor([[2.0, 2.0, 7.0]])
    assert explained_variance(constant, constant, mask).item() == 1.0  # perfect prediction of a constant
    assert explained_variance(torch.tensor([[1.0, 3.0, 0.0]]), constant, mask).item() == 0.0  # Var[y] = 0
    assert explained_variance(constant, torch.tensor([[1.0, 3.0, 0.0]]), mask).item() == 0.0  # predicts the mean
    assert explained_variance(constant, constant, torch.zeros_like(mask)).item() == 0.0  # nothing to explain
