"""dis_policy_loss and ppo_clip_policy_loss: values, exact gradients, band edges, empty inputs, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algo import dis_policy_loss, ppo_clip_policy_loss

from .reference import dis_grad_loop


@st.composite
def token_batches(draw: st.DrawFn) -> dict:
    rows, length = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    size = rows * length
    mask = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    rollout = draw(st.lists(st.floats(-8, 0), min_size=size, max_size=size))
    # log-ratios from -3 to 3 put tokens below, inside and above the band
    logratio = draw(st.lists(st.floats(-3, 3), min_size=size, max_size=size))
    advantages = draw(st.lists(st.floats(-4, 4), min_size=size, max_size=size))
    eps_low = draw(st.floats(0.05, 0.95))
    eps_high = draw(st.floats(0.05, 8.0))
    override = draw(st.none() | st.integers(1, 500))
    return dict(
        shape=(rows, length), mask=mask, rollout=rollout, logprobs=[r + d for r, d in zip(rollout, logratio)],
        advantages=advantages, eps_low=eps_low, eps_high=eps_high, override=override,
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(token_batches())
def test_dis_gradient_equals_minus_mask_ratio_advantage_over_n(case: dict) -> None:
    shape = case["shape"]
    logprobs = torch.tensor(case["logprobs"], dtype=torch.float64).view(shape).requires_grad_()
    rollout = torch.tensor(case["rollout"], dtype=torch.float64).view(shape)
    advantages = torch.tensor(case["advantages"], dtype=torch.float64).view(shape)
    mask = torch.tensor(case["mask"]).view(shape)
    loss, _ = dis_policy_loss(
        logprobs, rollout, advantages, mask, case["eps_low"], case["eps_high"], num_action_tokens=case["override"]
    )
    loss.backward()
    n = case["override"] or max(sum(case["mask"]), 1)
    ref_loss, ref_grad, in_band = dis_grad_loop(
        case["logprobs"], case["rollout"], case["advantages"], case["mask"], case["eps_low"], case["eps_high"], n
    )
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-9, abs_tol=1e-12)
    grad, ref = logprobs.grad.flatten(), torch.tensor(ref_grad, dtype=torch.float64)
    torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-300)  # atol: subnormal products round differently
    assert (grad[~torch.tensor(in_band)] == 0).all()  # out of band or off the mask: exactly zero


def test_dis_loss_hand_example_keeps_masked_tokens_in_n() -> None:
    # 5 action tokens (eps 0.3 / 5.0 -> band (0.7, 6)), one padding token:
    #   r = 1.0 (A=2)   in band  ->  2.0
    #   r = 0.5 (A=1)   below    ->  0
    #   r = 2.0 (A=-1)  in band  -> -2.0
    #   r = 7.0 (A=3)   above    ->  0
    #   r = 0.8 (A=1)   in band  ->  0.8
    # loss = -(2 - 2 + 0.8) / 5 = -0.16   (N = 5, the masked tokens stay in N)
    ratio = torch.tensor([[1.0, 0.5, 2.0, 7.0, 0.8, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[2.0, 1.0, -1.0, 3.0, 1.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    rollout = torch.full_like(ratio, -1.0)
    logprobs = (rollout + ratio.log()).requires_grad_()
    loss, metrics = dis_policy_loss(logprobs, rollout, advantages, mask, eps_low=0.3, eps_high=5.0)
    assert math.isclose(loss.item(), -0.16, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.4, 0, 0.4, 0, -0.16, 0]], dtype=torch.float64))
    assert metrics["dis/masked_frac"].item() == pytest.approx(0.4)
    assert metrics["dis/masked_low_frac"].item() == pytest.approx(0.2)
    assert metrics["dis/masked_high_frac"].item() == pytest.approx(0.2)
    assert metrics["dis/ratio_mean"].item() == pytest.approx((1.0 + 0.5 + 2.0 + 7.0 + 0.8) / 5)
    assert metrics["dis/ratio_max"].item() == pytest.approx(7.0)
    k3 = sum(r - 1 - math.log(r) for r in [1.0, 0.5, 2.0, 7.0, 0.8]) / 5
    assert metrics["dis/mismatch_kl"].item() == pytest.approx(k3)
    assert metrics["dis/num_action_tokens"].item() == 5


def test_dis_band_edges_are_out_of_band() -> None:
    eps_low, eps_high = 0.5, 1.0  # band (0.5, 2.0): both edges exact in binary
    logratio = torch.tensor([[math.log(0.5), math.log(2.0)]], dtype=torch.float64)
    assert torch.exp(logratio).tolist() == [[0.5, 2.0]]  # the ratios are exactly on the edges
    inside = torch.tensor([[math.nextafter(0.5, 1.0), math.nextafter(2.0, 0.0)]], dtype=torch.float64)
    for ratios, expected_masked in ((torch.exp(logratio), 1.0), (inside, 0.0)):
        logprobs = ratios.log().requires_grad_()
        loss, metrics = dis_policy_loss(
            logprobs, torch.zeros_like(ratios), torch.ones_like(ratios), torch.ones_like(ratios, dtype=torch.bool),
            eps_low=eps_low, eps_high=eps_high,
        )  # fmt: skip
        loss.backward()
        assert metrics["dis/masked_frac"].item() == expected_masked
        assert ((logprobs.grad == 0).all().item()) == (expected_masked == 1.0)


def test_dis_out_of_band_and_non_action_tokens_get_exactly_zero_gradient() -> None:
    # token 0: far above the band (r = e^200 overflows); token 1: far below; token 2: padding whose rollout
    # log-prob is garbage; token 3: in band
    logprobs = torch.tensor([[0.0, -50.0, 0.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-200.0, 0.0, -1e30, -1.1]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False, True]])
    loss, metrics = dis_policy_loss(logprobs, rollout, advantages, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, :3].tolist() == [0.0, 0.0, 0.0]
    assert logprobs.grad[0, 3].item() == pytest.approx(-math.exp(0.1) / 3, rel=1e-6)
    assert metrics["dis/masked_frac"].item() == pytest.approx(2 / 3)


def test_dis_empty_rows_and_empty_batch_give_zero_loss_not_nan() -> None:
    g = torch.Generator().manual_seed(5)
    logprobs = (-torch.rand(2, 5, generator=g)).requires_grad_()
    rollout, advantages = logprobs.detach() + 0.1, torch.randn(2, 5, generator=g)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    loss, metrics = dis_policy_loss(logprobs, rollout, advantages, mask)
    loss.backward()
    assert loss.item() == 0.0 and (logprobs.grad == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # an empty row next to a full one changes nothing
    mask[1] = True
    full, _ = dis_policy_loss(logprobs[1:], rollout[1:], advantages[1:], mask[1:])
    both, _ = dis_policy_loss(logprobs, rollout, advantages, mask)
    assert full.item() != 0.0
    torch.testing.assert_close(full, both)


def test_dis_micro_batches_with_step_normalizer_add_up_to_full_batch_loss() -> None:
    g = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(6, 30, generator=g)).requires_grad_()
    rollout = logprobs.detach() + 0.3 * torch.randn(6, 30, generator=g)
    advantages = torch.randn(6, 30, generator=g)
    mask = torch.rand(6, 30, generator=g) < 0.7
    full, _ = dis_policy_loss(logprobs, rollout, advantages, mask)
    full.backward()
    full_grad = logprobs.grad.clone()
    logprobs.grad = None
    total = int(mask.sum())
    parts = [dis_policy_loss(logprobs[i : i + 2], rollout[i : i + 2], advantages[i : i + 2], mask[i : i + 2],
                             num_action_tokens=torch.tensor(total))[0] for i in range(0, 6, 2)]  # fmt: skip
    sum(parts).backward()
    torch.testing.assert_close(sum(parts), full)
    torch.testing.assert_close(logprobs.grad, full_grad)


def test_dis_mismatch_kl_estimates_kl_rollout_to_learner() -> None:
    """Tokens sampled from the rollout policy p: the k3 metric converges to KL(p || q), not KL(q || p)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)  # rollout
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)  # learner
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, rollout = q.log()[tokens].view(1, -1), p.log()[tokens].view(1, -1)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    _, metrics = dis_policy_loss(logprobs, rollout, torch.zeros_like(logprobs), mask, eps_low=0.9, eps_high=100.0)
    kl_pq = (p * (p / q).log()).sum().item()  # 0.2283
    kl_qp = (q * (q / p).log()).sum().item()  # 0.3256
    assert metrics["dis/mismatch_kl"].item() == pytest.approx(kl_pq, abs=0.01)
    assert abs(kl_pq - kl_qp) > 0.05


def test_dis_bf16_inputs_give_fp32_loss() -> None:
    logprobs = torch.full((2, 4), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, metrics = dis_policy_loss(logprobs, logprobs.detach(), torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool))
    assert loss.dtype == torch.float32 and loss.item() == -1.0
    loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16
    assert metrics["dis/mismatch_kl"].item() == 0.0 and metrics["dis/ratio_max"].item() == 1.0


def test_dis_rejects_bad_arguments() -> None:
    x, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(x, x, x, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="eps_high"):
        dis_policy_loss(x, x, x, mask, eps_high=0.0)
    with pytest.raises(ValueError, match="num_action_tokens=0.0 must be > 0"):
        dis_policy_loss(x, x, x, mask, num_action_tokens=0)
    with pytest.raises(ValueError, match="advantages must be a float tensor shaped like action_mask"):
        dis_policy_loss(x, x, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="action_mask must be a bool"):
        dis_policy_loss(x, x, x, mask.float())


def test_ppo_clip_loss_hand_example() -> None:
    # clip_eps 0.2: per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r = 1.5, A =  1: max(-1.5, -1.2) = -1.2  (clipped: no gradient)
    #   r = 1.5, A = -1: max( 1.5,  1.2) =  1.5  (unclipped: gradient -A r = 1.5)
    #   r = 0.5, A =  1: max(-0.5, -0.8) = -0.5  (unclipped: gradient -0.5)
    #   r = 1.0, A =  2: -2.0                     (gradient -2)
    # loss = (-1.2 + 1.5 - 0.5 - 2.0) / 4 = -0.55
    ratio = torch.tensor([[1.5, 1.5, 0.5, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, 1.0, 2.0]], dtype=torch.float64)
    old = torch.full_like(ratio, -2.0)
    logprobs = (old + ratio.log()).requires_grad_()
    loss, metrics = ppo_clip_policy_loss(logprobs, old, advantages, torch.ones_like(ratio, dtype=torch.bool), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-0.55)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 1.5, -0.5, -2.0]], dtype=torch.float64) / 4)
    assert metrics["ppo/clipfrac"].item() == pytest.approx(0.75)  # three ratios outside [0.8, 1.2]
    # clip-higher: with clip_eps_high = 0.6, r = 1.5 is inside the range, so token 0 counts -1.5 and has a gradient
    logprobs.grad = None
    loss, metrics = ppo_clip_policy_loss(logprobs, old, advantages, torch.ones_like(ratio, dtype=torch.bool), 0.2, 0.6)
    assert loss.item() == pytest.approx((-1.5 + 1.5 - 0.5 - 2.0) / 4)
    assert metrics["ppo/clipfrac"].item() == pytest.approx(0.25)
