"""compute_gae / length_adaptive_lambda against an independent float64 loop and hand-worked trajectories."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algo import compute_gae, gae_span, length_adaptive_lambda
from megatron_sao.algo.gae import reverse_discounted_scan

from .reference import gae_loop


@st.composite
def trajectories(draw: st.DrawFn, max_rows: int = 4, max_len: int = 150) -> dict:
    """Rows laid out as prompt, then alternating action runs and observation gaps, then padding."""
    rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(1, max_len))
    mask = []
    for _ in range(rows):
        row: list[bool] = [False] * draw(st.integers(0, min(5, length)))  # prompt
        while len(row) < length and draw(st.booleans()):
            row += [True] * draw(st.integers(1, 20)) + [False] * draw(st.integers(0, 10))  # turn, observation
        mask.append((row + [False] * length)[:length])  # padding
    finite = st.floats(-5, 5, allow_nan=False, width=64)
    values = [[draw(finite) for _ in range(length)] for _ in range(rows)]
    rewards = [[draw(finite) if m and draw(st.booleans()) else 0.0 for m in row] for row in mask]
    gamma = draw(st.sampled_from([0.0, 1.0]) | st.floats(0, 1))
    lam = draw(st.sampled_from([0.0, 1.0]) | st.floats(0, 1) | st.lists(st.floats(0, 1), min_size=rows, max_size=rows))
    return dict(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam)


def _as_tensors(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    lam = case["lam"]
    lam_arg = torch.tensor(lam, dtype=dtype) if isinstance(lam, list) else lam
    return (
        torch.tensor(case["rewards"], dtype=dtype),
        torch.tensor(case["values"], dtype=dtype),
        torch.tensor(case["mask"], dtype=torch.bool),
        lam_arg,
    )


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_gae_matches_per_row_loop_reference_float64(case: dict) -> None:
    rewards, values, mask, lam = _as_tensors(case, torch.float64)
    advantages, returns = compute_gae(rewards, values, mask, case["gamma"], lam)
    ref_adv, ref_ret = gae_loop(case["rewards"], case["values"], case["mask"], case["gamma"], case["lam"])
    assert advantages.dtype == torch.float64
    torch.testing.assert_close(advantages, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(returns, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(trajectories())
def test_gae_matches_per_row_loop_reference_float32(case: dict) -> None:
    rewards, values, mask, lam = _as_tensors(case, torch.float32)
    advantages, returns = compute_gae(rewards, values, mask, case["gamma"], lam)
    ref_adv, ref_ret = gae_loop(case["rewards"], case["values"], case["mask"], case["gamma"], case["lam"])
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages.double(), torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(returns.double(), torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-4, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(trajectories(), st.floats(-100, 100))
def test_gae_ignores_values_on_observation_tokens(case: dict, garbage: float) -> None:
    rewards, values, mask, lam = _as_tensors(case, torch.float64)
    noisy = torch.where(mask, values, torch.full_like(values, garbage))
    advantages, returns = compute_gae(rewards, values, mask, case["gamma"], lam)
    noisy_advantages, noisy_returns = compute_gae(rewards, noisy, mask, case["gamma"], lam)
    assert torch.equal(advantages, noisy_advantages) and torch.equal(returns, noisy_returns)


@settings(max_examples=100, deadline=None)
@given(trajectories())
def test_gae_is_zero_off_action_tokens_and_finite(case: dict) -> None:
    rewards, values, mask, lam = _as_tensors(case, torch.float32)
    for out in compute_gae(rewards, values, mask, case["gamma"], lam):
        assert torch.isfinite(out).all()
        assert (out[~mask] == 0).all()


# Hand-worked two-turn trajectory: [prompt p p | turn 0: a0 a1 | observation o o | turn 1: a2 a3 | pad]
TWO_TURN_MASK = [[False, False, True, True, False, False, True, True, False]]
# V on a0..a3 = 0.5, 0.4, 0.6, 0.8; the observation/prompt values (9.0) must never be used
TWO_TURN_VALUES = [[9.0, 9.0, 0.5, 0.4, 9.0, 9.0, 0.6, 0.8, 9.0]]
TWO_TURN_REWARDS = [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]  # terminal reward 1 on a3


def test_gae_skips_observation_tokens_two_turn_hand_example() -> None:
    # gamma = 1, lam = 0.5, by hand:
    #   a3: delta = 1 + 1*0   - 0.8 =  0.2   A = 0.2
    #   a2: delta = 0 + 1*0.8 - 0.6 =  0.2   A = 0.2  + 0.5*0.2  = 0.3
    #   a1: delta = 0 + 1*0.6 - 0.4 =  0.2   A = 0.2  + 0.5*0.3  = 0.35   (bootstraps from a2, across o o)
    #   a0: delta = 0 + 1*0.4 - 0.5 = -0.1   A = -0.1 + 0.5*0.35 = 0.075
    #   returns = A + V = 0.575, 0.75, 0.9, 1.0
    rewards, values = torch.tensor(TWO_TURN_REWARDS), torch.tensor(TWO_TURN_VALUES)
    advantages, returns = compute_gae(rewards, values, torch.tensor(TWO_TURN_MASK), gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0, 0, 0.075, 0.35, 0, 0, 0.3, 0.2, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0, 0.575, 0.75, 0, 0, 0.9, 1.0, 0]]))


def test_gae_two_turn_hand_example_discounts_per_action_token_not_per_position() -> None:
    # gamma = 0.9, lam = 1: the discount counts action tokens only, so the returns are 0.9^k * reward with k the
    # number of action tokens after the token (the 2-token observation gap adds no discount):
    #   a3: A = 1 - 0.8 = 0.2                         R = 1.0
    #   a2: delta = 0.9*0.8 - 0.6 = 0.12,  A = 0.12 + 0.9*0.2  = 0.3     R = 0.9
    #   a1: delta = 0.9*0.6 - 0.4 = 0.14,  A = 0.14 + 0.9*0.3  = 0.41    R = 0.81
    #   a0: delta = 0.9*0.4 - 0.5 = -0.14, A = -0.14 + 0.9*0.41 = 0.229  R = 0.729
    rewards, values = torch.tensor(TWO_TURN_REWARDS), torch.tensor(TWO_TURN_VALUES)
    advantages, returns = compute_gae(rewards, values, torch.tensor(TWO_TURN_MASK), gamma=0.9, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0, 0, 0.229, 0.41, 0, 0, 0.3, 0.2, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0, 0.729, 0.81, 0, 0, 0.9, 1.0, 0]]))


def test_gae_two_turn_hand_example_with_per_turn_reward() -> None:
    # as the first example plus a turn reward 0.5 on a1 (last token of turn 0); gamma = 1, lam = 0.5:
    #   a3, a2 unchanged: A = 0.2, 0.3
    #   a1: delta = 0.5 + 0.6 - 0.4 = 0.7   A = 0.7 + 0.5*0.3 = 0.85
    #   a0: delta = 0.4 - 0.5 = -0.1        A = -0.1 + 0.5*0.85 = 0.325
    rewards = torch.tensor(TWO_TURN_REWARDS)
    rewards[0, 3] = 0.5
    advantages, _ = compute_gae(rewards, torch.tensor(TWO_TURN_VALUES), torch.tensor(TWO_TURN_MASK), 1.0, 0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0, 0, 0.325, 0.85, 0, 0, 0.3, 0.2, 0]]))


def test_gae_per_row_lambda_equals_separate_scalar_calls() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 200, generator=g) < 0.6
    values = torch.randn(3, 200, generator=g, dtype=torch.float64)
    rewards = torch.where(mask, torch.randn(3, 200, generator=g, dtype=torch.float64), 0.0)
    lam = torch.tensor([0.0, 0.7, 1.0], dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, mask, 0.95, lam)
    for b in range(3):
        adv_b, ret_b = compute_gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 0.95, float(lam[b]))
        torch.testing.assert_close(advantages[b : b + 1], adv_b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(returns[b : b + 1], ret_b, rtol=1e-12, atol=1e-12)


def test_gae_rows_without_action_tokens_are_zero_not_nan() -> None:
    mask = torch.tensor([[False] * 6, [False, True, True, False, True, False]])
    values = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    rewards = torch.zeros(2, 6)
    rewards[1, 4] = 1.0
    advantages, returns = compute_gae(rewards, values, mask, 1.0, length_adaptive_lambda(mask))
    assert (advantages[0] == 0).all() and (returns[0] == 0).all()
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    empty = torch.zeros(2, 0)
    assert compute_gae(empty, empty, empty.bool(), 1.0, 1.0)[0].shape == (2, 0)


def test_gae_rejects_reward_on_non_action_token() -> None:
    rewards, values = torch.tensor(TWO_TURN_REWARDS), torch.tensor(TWO_TURN_VALUES)
    rewards[0, 8] = 1.0  # on the padding after the last action token
    with pytest.raises(ValueError, match=r"position 8, which is not an action token.*token_rewards"):
        compute_gae(rewards, values, torch.tensor(TWO_TURN_MASK), 1.0, 0.5)
    rewards[0, 8] = 0.0
    rewards[0, 4] = -0.5  # on an observation token
    with pytest.raises(ValueError, match="position 4"):
        compute_gae(rewards, values, torch.tensor(TWO_TURN_MASK), 1.0, 0.5)


def test_gae_rejects_bad_arguments() -> None:
    r = torch.zeros(2, 5)
    m = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, r, m, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="lam must be in"):
        compute_gae(r, r, m, gamma=1.0, lam=torch.tensor([0.5, 1.2]))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        compute_gae(r, r, m, gamma=1.0, lam=torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match="bool"):
        compute_gae(r, r, m.float(), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="values must be a float tensor shaped like action_mask"):
        compute_gae(r, torch.zeros(2, 4), m, gamma=1.0, lam=1.0)


def test_gae_bf16_inputs_compute_and_return_fp32_without_grad() -> None:
    rewards, mask = torch.tensor(TWO_TURN_REWARDS), torch.tensor(TWO_TURN_MASK)
    values = torch.tensor(TWO_TURN_VALUES, dtype=torch.bfloat16, requires_grad=True)
    advantages, returns = compute_gae(rewards.bfloat16(), values, mask, 1.0, 0.5)
    assert advantages.dtype == returns.dtype == torch.float32
    assert not advantages.requires_grad and not returns.requires_grad
    # 0.4, 0.6, 0.8 are not exact in bf16; the result is GAE of the rounded values, computed in fp32
    expected, _ = compute_gae(rewards, values.detach().float(), mask, 1.0, 0.5)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, "adaptive"), (1.0, 1.0), (0.999, 0.95), (0.5, 0.5)])
def test_gae_long_trajectories_t32768_match_float64_loop(gamma: float, lam: float | str) -> None:
    """fp32 blocked scan at T = 32768 with observation gaps, against the float64 loop (relative to the scale)."""
    g = torch.Generator().manual_seed(7)
    rows, length = 3, 32768
    mask = _realistic_mask(rows, length, g)
    values = torch.randn(rows, length, generator=g)
    rewards = torch.where(mask, torch.randn(rows, length, generator=g) * 0.05, 0.0)  # dense rewards: worst case
    lam_arg = length_adaptive_lambda(mask) if lam == "adaptive" else lam
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam_arg)
    lam_ref = lam_arg.double().tolist() if isinstance(lam_arg, torch.Tensor) else lam_arg
    ref_adv, ref_ret = gae_loop(rewards.double().tolist(), values.double().tolist(), mask.tolist(), gamma, lam_ref)
    ref_adv, ref_ret = torch.tensor(ref_adv, dtype=torch.float64), torch.tensor(ref_ret, dtype=torch.float64)
    scale = ref_adv.abs().max().item()
    err = (advantages.double() - ref_adv).abs().max().item()
    assert err <= 1e-5 * max(scale, 1.0), f"max abs error {err:.3g} for max |A| {scale:.3g}"
    assert (returns.double() - ref_ret).abs().max().item() <= 1e-5 * max(ref_ret.abs().max().item(), 1.0)


def _realistic_mask(rows: int, length: int, g: torch.Generator) -> torch.Tensor:
    """Prompt, then turns of 50-1500 generated tokens separated by observations of 10-500 tokens."""
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        pos = int(torch.randint(100, 1000, (1,), generator=g))
        while pos < length:
            turn = int(torch.randint(50, 1500, (1,), generator=g))
            mask[b, pos : pos + turn] = True
            pos += turn + int(torch.randint(10, 500, (1,), generator=g))
    return mask


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 127, 4096, 4097])
@pytest.mark.parametrize("coef", [0.0, 0.3, 0.999, 1.0])
def test_reverse_discounted_scan_matches_loop_across_block_edges(length: int, coef: float) -> None:
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
    y = reverse_discounted_scan(x, torch.full((2,), coef, dtype=torch.float64))
    expected = torch.zeros_like(x)
    running = torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(length)):
        running = x[:, t] + coef * running
        expected[:, t] = running
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)


def test_length_adaptive_lambda_is_one_minus_inverse_alpha_l() -> None:
    lengths = [0, 1, 3, 100, 32768]
    mask = torch.zeros(len(lengths), 32768, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 5 : 5 + n] = True  # position does not matter, only the count
    lam = length_adaptive_lambda(mask, alpha=1.5)
    expected = [0.0, 1 - 1 / 1.5, 1 - 1 / 4.5, 1 - 1 / 150, 1 - 1 / (1.5 * 32768)]
    assert lam.dtype == torch.float32
    torch.testing.assert_close(lam, torch.tensor(expected), rtol=0, atol=1e-7)
    # alpha * l < 1 would give a negative lambda: clamped to 0
    assert length_adaptive_lambda(mask[1:2], alpha=0.5).item() == 0.0
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(mask, alpha=0.0)


def test_length_adaptive_lambda_counts_action_tokens_not_positions() -> None:
    spread = torch.tensor([[True, False, False, True, False, True]])  # 3 action tokens across gaps
    assert math.isclose(length_adaptive_lambda(spread, 1.5).item(), 1 - 1 / 4.5, rel_tol=1e-6)


def test_gae_span_covers_first_to_last_action_token_and_through_observations() -> None:
    mask = torch.tensor(
        [
            [0, 1, 1, 0, 0, 1, 0, 0],  # prompt, turn, observation, turn, padding
            [0, 0, 0, 0, 0, 0, 0, 0],  # no action tokens
            [1, 0, 0, 0, 0, 0, 0, 1],
            [0, 0, 0, 1, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    expected = torch.tensor(
        [[0, 1, 1, 1, 1, 1, 0, 0], [0] * 8, [1] * 8, [0, 0, 0, 1, 0, 0, 0, 0]],
        dtype=torch.bool,
    )
    assert torch.equal(gae_span(mask), expected)
    assert gae_span(torch.zeros(2, 0, dtype=torch.bool)).shape == (2, 0)


def test_gae_through_observations_bootstraps_from_the_observation_values() -> None:
    """Skipping observations, the last token of turn 1 bootstraps from turn 2's first value; through the span, from
    the observation token's value: the two differ exactly by what the observation values contribute."""
    mask = torch.tensor([[True, False, True]])
    values = torch.tensor([[0.5, 10.0, 0.2]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    skip, _ = compute_gae(rewards, values, mask, 1.0, 0.0)
    through, _ = compute_gae(rewards, values, gae_span(mask), 1.0, 0.0)
    assert skip[0, 0].item() == pytest.approx(0.2 - 0.5) and skip[0, 1].item() == 0.0
    assert through[0, 0].item() == pytest.approx(10.0 - 0.5) and through[0, 1].item() == pytest.approx(0.2 - 10.0)
