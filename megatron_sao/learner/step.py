"""The two updates of an SAO learner step, as loss functions over packed micro-batches.

    value update (K times):  v_loss = 0.5 * sum_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t) - R_t)^2) / N
    policy update (once):     pg_loss = -sum_t m_t * r_t * A_t / N,  r_t = exp(logp_t - logp_rollout_t)
N is the step's number of action tokens over every micro-batch and data-parallel rank: each loss function
returns its *sum* and token count, and megatron (calculate_per_token_loss) divides the gradients by the total.
Metrics come back as token-weighted sums so learner/metrics.py can average them over the whole step.
Called by learner/learner.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_sao.algo import dis_policy_loss, ppo_clip_policy_loss, value_loss
from megatron_sao.config.algo import AlgoConfig
from megatron_sao.learner.batch import StepBatch
from megatron_sao.learner.forward import run_microbatches, token_logprobs
from megatron_sao.learner.packing import MicroBatch
from megatron_sao.learner.roles import RoleModel

WeightedMetrics = dict[str, tuple[float, float]]
"""name -> (value * weight, weight). Losses (loss/*) are already sums (N = 1 in the algo calls): (sum, count).
Names ending in _max carry (max, 1) and are reduced with max."""


def _weighted(metrics: dict[str, Any], count: float) -> WeightedMetrics:
    out: WeightedMetrics = {}
    for name, value in metrics.items():
        v = float(value)
        if name.endswith(("num_action_tokens", "explained_variance")):  # step-level: see ev_totals
            continue
        if name.endswith("_total"):
            out[name] = (v, 1.0)
            continue
        if name.endswith("_max"):
            out[name] = (v, 1.0)
        elif name.startswith("loss/"):  # already normalized by the step's token count: summed, not token-weighted
            out[name] = (v, count)
        else:
            out[name] = (v * count, count)
    return out


def ev_totals(stem: str, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> WeightedMetrics:
    """Sufficient statistics of 1 - Var(R - V) / Var(R) over the masked tokens, as `<stem>{n,r,r2,e,e2}_total`
    entries that learner/metrics.py sums across micro-batches and ranks and `explained_variance` turns into one
    figure (a per-micro-batch explained variance would be meaningless)."""
    with torch.no_grad():
        r, resid = returns[mask].double(), (returns - values)[mask].double()
        sums = {"n": float(mask.sum()), "r": float(r.sum()), "r2": float((r * r).sum()), "e": float(resid.sum()),
                "e2": float((resid * resid).sum())}  # fmt: skip
        return {f"{stem}{k}_total": (v, 1.0) for k, v in sums.items()}


def first_action_tokens(action_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: each trajectory's first action position (the value there is the critic's estimate of the
    whole episode from the prompt alone)."""
    return action_mask & (action_mask.cumsum(dim=1) == 1)


def value_update(
    value: RoleModel,
    microbatches: list[MicroBatch],
    batch: StepBatch,
    returns: torch.Tensor | None,
    old_values: torch.Tensor,
    clip: float | None,
    value_mask: torch.Tensor | None = None,
    record_values: bool = False,
) -> tuple[list[WeightedMetrics], bool, float]:
    """One critic optimizer step on the whole step batch. `returns`/`old_values` [B, L] exist on the last
    pipeline stage (None/unused elsewhere). `value_mask` [B, L]: the tokens the critic is trained on (default the
    action tokens; the GAE span when `algo.gae.skip_observations` is off). `record_values`: this is the step's
    first update and its forward gives the step's values, written into `old_values` (the clip centre is then the
    values themselves: no clipping, as for a first update). Returns (per-micro-batch metrics, update ok, grad
    norm)."""
    trained = batch.action_mask if value_mask is None else value_mask

    def loss_fn(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert returns is not None, "value loss evaluated off the last pipeline stage"
        dev = output.device
        mask = mb.pack(trained).to(dev)
        values = output.reshape(1, -1).float()
        if record_values:
            mb.unpack_into(values[0].detach().cpu(), old_values)
            centre = values.detach()
        else:
            centre = mb.pack(old_values).to(dev)[None]
        loss, m = value_loss(
            values, centre, mb.pack(returns).to(dev)[None], mask[None], clip=clip, num_action_tokens=1.0,
        )  # fmt: skip
        count = mask.sum()
        totals = ev_totals("value/ev_", values[0].detach(), mb.pack(returns).to(dev), mask)
        return loss, count.to(torch.int), {**_weighted(m, float(count)), **totals}

    value.zero_grad()
    results = run_microbatches(value.ddp, microbatches, loss_fn, forward_only=False, routing=value.routing)
    ok, grad_norm = value.step()
    return results, ok, grad_norm


def dis_band(algo: AlgoConfig) -> tuple[float, float]:
    """(eps_low, eps_high) of the DIS loss; with `algo.dis.mask` off, a band no finite ratio leaves (plain IS: only a
    ratio that over- or underflows the float range is masked, where plain IS would give an Inf or exact-0 term)."""
    return (algo.dis.eps_low, algo.dis.eps_high) if algo.dis.mask else (1.0, math.inf)


def policy_update(
    policy: RoleModel,
    microbatches: list[MicroBatch],
    batch: StepBatch,
    advantages: torch.Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    vocab_size: int,
) -> tuple[list[WeightedMetrics], bool, float]:
    """One policy optimizer step: DIS (or PPO-clip for the GRPO arm with policy_loss=ppo_clip) against the
    engines' logged log-probs. `advantages` [B, L] exists on the last pipeline stage."""
    use_ppo_clip = algo.grouped and algo.grpo.policy_loss == "ppo_clip"

    def loss_fn(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert advantages is not None, "policy loss evaluated off the last pipeline stage"
        dev = output.device
        logp = token_logprobs(
            output.reshape(mb.seq_len, -1), mb.targets(), temperature, vocab_size, tp_rank=policy.tp_rank
        )[None]
        rollout = mb.pack(batch.rollout_logprobs).to(dev)[None]
        adv = mb.pack(advantages).to(dev)[None]
        mask = mb.pack(batch.action_mask).to(dev)[None]
        if use_ppo_clip:
            loss, m = ppo_clip_policy_loss(
                logp, rollout, adv, mask, algo.grpo.clip_eps, algo.grpo.clip_eps_high, num_action_tokens=1.0
            )
        else:
            loss, m = dis_policy_loss(logp, rollout, adv, mask, *dis_band(algo), 1.0)
        count = mask.sum()
        return loss, count.to(torch.int), _weighted(m, float(count))

    policy.zero_grad()
    results = run_microbatches(policy.ddp, microbatches, loss_fn, forward_only=False, routing=policy.routing)
    ok, grad_norm = policy.step()
    return results, ok, grad_norm
