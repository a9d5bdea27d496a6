"""token_rewards, compute_step_targets (the learner's per-step helper) and sequence_to_token_advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.algo import (
    compute_gae,
    compute_step_targets,
    dis_policy_loss,
    length_adaptive_lambda,
    sequence_to_token_advantages,
    token_rewards,
    value_loss,
)
from megatron_sao.config import AlgoConfig

# row 0: [prompt | turn 0: 3 tokens | obs 2 | turn 1: 2 tokens | pad]; row 1: no action tokens;
# row 2: two turns back to back (no observation between): one run of 4 action tokens
MASK = torch.tensor(
    [
        [False, True, True, True, False, False, True, True, False],
        [False] * 9,
        [False, False, True, True, True, True, False, False, False],
    ]
)


def test_token_rewards_puts_terminal_reward_on_last_action_token() -> None:
    rewards = token_rewards(MASK, torch.tensor([1.0, 0.0, -2.0]))
    expected = torch.zeros(3, 9)
    expected[0, 7], expected[2, 5] = 1.0, -2.0
    assert rewards.dtype == torch.float32 and torch.equal(rewards, expected)


def test_token_rewards_puts_turn_rewards_on_last_token_of_each_turn() -> None:
    turn = torch.tensor([[0.5, 0.25], [0.0, 0.0], [0.125, 0.0]])
    rewards = token_rewards(MASK, torch.tensor([1.0, 0.0, 0.0]), turn_rewards=turn)
    expected = torch.zeros(3, 9)
    expected[0, 3] = 0.5  # end of turn 0 (before the observation)
    expected[0, 7] = 1.0 + 0.25  # terminal + last turn
    expected[2, 5] = 0.125  # back-to-back turns merge into one run without turn_index
    assert torch.equal(rewards, expected)
    # with turn_index (from the bus Turn ranges) the back-to-back turns of row 2 are told apart
    turn_index = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 0], [0] * 9, [0, 0, 0, 0, 1, 1, 0, 0, 0]])
    turn = torch.tensor([[0.5, 0.25], [0.0, 0.0], [0.125, 0.75]])
    rewards = token_rewards(MASK, torch.zeros(3), turn_rewards=turn, turn_index=turn_index)
    assert rewards[2].tolist() == [0, 0, 0, 0.125, 0, 0.75, 0, 0, 0]
    assert rewards[0].tolist() == [0, 0, 0, 0.5, 0, 0, 0, 0.25, 0]


def test_token_rewards_rejects_rewards_with_nowhere_to_go() -> None:
    with pytest.raises(ValueError, match="row 1 has reward 1.0 but no action tokens"):
        token_rewards(MASK, torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"turn_rewards\[2, 1\] is non-zero"):  # row 2 has one run only
        token_rewards(MASK, torch.zeros(3), turn_rewards=torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 1.0]]))


def test_step_targets_use_length_adaptive_lambda_for_policy_and_lambda_one_for_critic() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = token_rewards(MASK, torch.tensor([1.0, 0.0, 0.5]))
    values = torch.randn(3, 9, generator=g)
    targets = compute_step_targets(rewards, values, MASK, AlgoConfig())
    lam = length_adaptive_lambda(MASK, 1.5)
    torch.testing.assert_close(targets.lambda_policy, lam)
    torch.testing.assert_close(targets.advantages, compute_gae(rewards, values, MASK, 1.0, lam)[0])
    # gamma = 1, lambda_critic = 1: returns are Monte-Carlo sums of the rewards on later action tokens
    monte_carlo = torch.where(MASK, rewards.flip(1).cumsum(1).flip(1), 0.0)
    torch.testing.assert_close(targets.returns, monte_carlo)
    assert set(targets.metrics) == {"gae/lambda_policy_mean", "gae/advantages_mean", "gae/advantages_std",
                                    "gae/returns_mean"}  # fmt: skip


def test_step_targets_fixed_lambda_and_whitening_follow_the_config() -> None:
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(4, 50, generator=g) < 0.7
    rewards = token_rewards(mask, torch.randn(4, generator=g))
    values = torch.randn(4, 50, generator=g)
    config = AlgoConfig.model_validate({"gae": {"lambda_policy": 0.9, "gamma": 0.99}})
    targets = compute_step_targets(rewards, values, mask, config.gae)
    assert (targets.lambda_policy == 0.9).all()
    torch.testing.assert_close(targets.advantages, compute_gae(rewards, values, mask, 0.99, 0.9)[0])
    torch.testing.assert_close(targets.returns, compute_gae(rewards, values, mask, 0.99, 1.0)[1])
    config.gae.whiten_advantages = True
    white = compute_step_targets(rewards, values, mask, config).advantages
    assert white[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert white[mask].std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
    assert (white[~mask] == 0).all()


def test_sequence_to_token_advantages_fills_action_tokens_only() -> None:
    adv = sequence_to_token_advantages(torch.tensor([2.0, 5.0, -1.0]), MASK)
    assert torch.equal(adv, torch.where(MASK, torch.tensor([[2.0], [5.0], [-1.0]]), 0.0))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        sequence_to_token_advantages(torch.zeros(2), MASK)


def test_one_sao_step_end_to_end_gives_finite_losses_and_gradients() -> None:
    """token rewards -> targets -> value loss and DIS loss, as the learner will chain them."""
    g = torch.Generator().manual_seed(2)
    rewards = token_rewards(MASK, torch.tensor([1.0, 0.0, 0.0]))
    old_values = torch.randn(3, 9, generator=g)
    targets = compute_step_targets(rewards, old_values, MASK, AlgoConfig())
    values = (old_values + 0.1 * torch.randn(3, 9, generator=g)).requires_grad_()
    logprobs = (-torch.rand(3, 9, generator=g)).requires_grad_()
    rollout = logprobs.detach() + 0.05 * torch.randn(3, 9, generator=g)
    v_loss, _ = value_loss(values, old_values, targets.returns, MASK, clip=0.2)
    pg_loss, _ = dis_policy_loss(logprobs, rollout, targets.advantages, MASK)
    (v_loss + pg_loss).backward()
    for grad in (values.grad, logprobs.grad):
        assert torch.isfinite(grad).all() and (grad[~MASK] == 0).all() and (grad[MASK] != 0).any()


def test_whitening_covers_the_policy_tokens_of_every_shard() -> None:
    from megatron_sao.algo.advantages import whiten

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 20, generator=g) * 3 + 1
    mask = torch.rand(6, 20, generator=g) < 0.6
    whole = whiten(x, mask)
    # two data-parallel shards of the step, whitened with moments summed over both: the same as the whole step
    shards = [(x[:2], mask[:2]), (x[2:], mask[2:])]

    def stats(xs, ms):
        picked = xs[ms].double()
        return torch.stack([picked.new_tensor(float(picked.numel())), picked.sum(), (picked * picked).sum()])

    total = sum(stats(xs, ms) for xs, ms in shards)
    parts = [whiten(xs, ms, moments=lambda _: total) for xs, ms in shards]
    torch.testing.assert_close(torch.cat(parts), whole)
    assert not torch.allclose(whiten(*shards[0]), whole[:2])  # each shard alone: another mean and spread


def test_step_targets_whiten_over_action_tokens_when_gae_spans_observations() -> None:
    from megatron_sao.algo import gae_span

    g = torch.Generator().manual_seed(4)
    action = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    span = gae_span(action)
    assert (span & ~action).any()  # observation tokens inside the span
    rewards = token_rewards(action, torch.tensor([1.0, -0.5]))
    values = torch.randn(2, 8, generator=g)
    config = AlgoConfig.model_validate({"gae": {"whiten_advantages": True, "skip_observations": False}})
    adv = compute_step_targets(rewards, values, span, config, policy_mask=action).advantages
    assert (adv[~action] == 0).all()
    assert adv[action].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[action].std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
