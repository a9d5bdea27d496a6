"""grpo_advantages (group-mean baseline) and RunningMeanBaseline (single-rollout, window 8)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sao.algo import RunningMeanBaseline, grpo_advantages


def test_grpo_advantages_hand_example_with_unbiased_std() -> None:
    # group "a": rewards 1, 0, 0, 1 (mean 0.5, unbiased std sqrt(1/3)); group "b": 2, 4 (mean 3, std sqrt(2))
    rewards = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
    ids = ["a", "b", "a", "a", "b", "a"]
    adv = grpo_advantages(rewards, ids, normalize_std=True, eps=0.0)
    s_a, s_b = math.sqrt(1 / 3), math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s_a, -1 / s_b, -0.5 / s_a, -0.5 / s_a, 1 / s_b, 0.5 / s_a]))
    centred = grpo_advantages(rewards, ids, normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -1.0, -0.5, -0.5, 1.0, 0.5]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-10, 10)), min_size=1, max_size=40))
def test_grpo_advantages_are_centred_and_unit_std_per_group(items: list[tuple[int, float]]) -> None:
    ids = torch.tensor([i for i, _ in items]) * 7 + 3  # arbitrary, non-contiguous integer ids
    rewards = torch.tensor([r for _, r in items], dtype=torch.float64)
    adv = grpo_advantages(rewards, ids, normalize_std=True)
    for g in ids.unique():
        group, group_adv = rewards[ids == g], adv[ids == g]
        assert group_adv.mean().item() == pytest.approx(0.0, abs=1e-9)
        if len(group) > 1 and group.std().item() > 1e-2:
            assert group_adv.std().item() == pytest.approx(1.0, rel=1e-4)  # eps = 1e-6 in the denominator
        elif (group == group[0]).all():  # one sample, or all equal: nothing to learn from the group
            assert (group_adv.abs() < 1e-6).all()


def test_grpo_advantages_single_member_and_constant_groups_are_zero_not_nan() -> None:
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([0, 1, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert grpo_advantages(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([0, 1, 1]), eps=0.0).tolist() == [0.0] * 3


def test_grpo_advantages_rejects_mismatched_ids() -> None:
    with pytest.raises(ValueError, match="one id per trajectory"):
        grpo_advantages(torch.zeros(3), ["a", "b"])
    with pytest.raises(ValueError, match="integer tensor"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))


def test_running_mean_baseline_is_computed_before_adding_the_reward() -> None:
    baseline = RunningMeanBaseline(window=3)
    # baselines before each reward: 0 (empty), 1, (1+2)/2, (1+2+3)/3, (2+3+4)/3 (window 3 drops the 1)
    adv = baseline.advantages(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, 1.5, 2.0, 2.0]))
    assert baseline.baseline == pytest.approx(4.0)  # (3 + 4 + 5) / 3
    assert baseline.num_seen == 5


def test_running_mean_baseline_batched_equals_one_at_a_time() -> None:
    rewards = torch.randn(20, generator=torch.Generator().manual_seed(0))
    batched, single = RunningMeanBaseline(8), RunningMeanBaseline(8)
    together = torch.cat([batched.advantages(rewards[:7]), batched.advantages(rewards[7:])])
    one_by_one = torch.cat([single.advantages(rewards[i : i + 1]) for i in range(20)])
    torch.testing.assert_close(together, one_by_one)


def test_running_mean_baseline_resumes_from_state_dict() -> None:
    rewards = torch.randn(30, generator=torch.Generator().manual_seed(1))
    uninterrupted = RunningMeanBaseline(8)
    expected = uninterrupted.advantages(rewards)
    first = RunningMeanBaseline(8)
    head = first.advantages(rewards[:13])
    resumed = RunningMeanBaseline(8)
    resumed.load_state_dict(first.state_dict())
    torch.testing.assert_close(torch.cat([head, resumed.advantages(rewards[13:])]), expected)
    with pytest.raises(ValueError, match="algo.running_mean.window=8"):
        RunningMeanBaseline(4).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="window"):
        RunningMeanBaseline(0)


def test_keyed_running_mean_keeps_one_window_per_key() -> None:
    from megatron_sao.algo import KeyedRunningMeanBaseline

    b = KeyedRunningMeanBaseline(window=2)
    adv = b.advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), ["easy", "hard", "easy", "hard", "easy"])
    # easy: 1 - 0, 1 - 1, 1 - 1; hard: 0 - 0, 0 - 0 (never the other key's rewards)
    assert adv.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    again = KeyedRunningMeanBaseline(window=2)
    again.load_state_dict(b.state_dict())
    assert again.advantages(torch.tensor([0.0]), ["easy"]).tolist() == [-1.0]
    with pytest.raises(ValueError, match="one key per trajectory"):
        b.advantages(torch.tensor([1.0]), [])


def test_the_oracle_state_values_give_return_minus_value_at_lambda_1_and_turn_td_at_lambda_0() -> None:
    from megatron_sao.algo import StateValueTable

    def table(lam: float) -> StateValueTable:
        t = StateValueTable(window=4, lambda_turn=lam)
        # history: from "2c" two returns (1, 0) -> 0.5; "1c" one return 1 -> 1.0; "1d" one return 0 -> 0.0
        t.turn_advantages([1.0, 0.0], [["2c", "1c"], ["2c", "1d"]])
        return t

    assert table(1.0).by_state["2c"].baseline == 0.5 and table(1.0).by_state["1d"].baseline == 0.0
    # a success on the chain (2c -> 1c -> R 1) and a failure that met a decoy (2c -> 1d -> R 0)
    # in stream order: the success's return joins V(2c) (-> 2/3) before the failure's advantages
    lam1 = table(1.0).turn_advantages([1.0, 0.0], [["2c", "1c"], ["2c", "1d"]])
    assert lam1.flatten().tolist() == pytest.approx([1.0 - 0.5, 1.0 - 1.0, 0.0 - 2 / 3, 0.0 - 0.0])  # R - V(s_t)
    td = table(0.0).turn_advantages([1.0, 0.0], [["2c", "1c"], ["2c", "1d"]])
    # V(s_t+1) - V(s_t): the failure's first turn is the one blamed, its doomed last turn is not (0)
    assert td.flatten().tolist() == pytest.approx([1.0 - 0.5, 1.0 - 1.0, 0.0 - 2 / 3, 0.0 - 0.0])
    half = table(0.5).turn_advantages([0.0], [["2c", "1c"]])  # delta_1 = 0 - 1, delta_0 = 1 - 0.5
    assert half.tolist() == [[0.5 + 0.5 * -1.0, -1.0]]


def test_turn_level_td_differs_from_return_minus_value_where_a_later_turn_is_to_blame() -> None:
    from megatron_sao.algo import StateValueTable

    t0, t1 = StateValueTable(4, 0.0), StateValueTable(4, 1.0)
    for t in (t0, t1):
        t.turn_advantages([1.0, 1.0, 0.0], [["3c", "2c", "1c"], ["3c", "2c", "1c"], ["3c", "2c", "1d"]])
    # V(3c) = 2/3, V(2c) = 2/3, V(1c) = 1, V(1d) = 0; a failure whose second lookup went wrong
    td = t0.turn_advantages([0.0], [["3c", "2c", "1d"]])[0].tolist()
    mc = t1.turn_advantages([0.0], [["3c", "2c", "1d"]])[0].tolist()
    assert td == pytest.approx([0.0, -2 / 3, 0.0])  # only the turn that led onto the decoy
    assert mc == pytest.approx([-2 / 3, -2 / 3, 0.0])  # every turn before the decoy alike


def test_turn_advantages_reach_each_action_token_of_their_turn() -> None:
    import torch

    from megatron_sao.algo import turn_to_token_advantages

    adv = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    turn_index = torch.tensor([[-1, 0, 0, -1, 1], [-1, -1, 0, 0, -1]])
    mask = turn_index >= 0
    out = turn_to_token_advantages(adv, turn_index, mask)
    assert out.tolist() == [[0.0, 0.5, 0.5, 0.0, -1.0], [0.0, 0.0, 2.0, 2.0, 0.0]]
    with pytest.raises(ValueError, match="past the 1 turns"):
        turn_to_token_advantages(adv[:, :1], turn_index, mask)
