"""Step metrics: token-weighted averages over micro-batches and data-parallel ranks, maxima for *_max, made
identical on every rank (so rank 0 logs them even when it is not the last pipeline stage)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sao.distributed.bootstrap import DistContext
from megatron_sao.learner.step import WeightedMetrics


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def reduce_metrics(per_microbatch: list[WeightedMetrics], layout: DistContext, prefix: str = "") -> dict[str, float]:
    """Collective over the world: every rank must call it with its (possibly empty) list; only the values of the
    ranks that hold the outputs count (layout.holds_outputs: last stage, TP rank 0, CP rank 0)."""
    contributes = layout.holds_outputs
    local: WeightedMetrics = {}
    for m in per_microbatch if contributes else []:
        for name, (v, w) in m.items():
            if name.endswith("_max"):
                prev = local.get(name, (float("-inf"), 1.0))[0]
                local[name] = (max(prev, v), 1.0)
            else:
                pv, pw = local.get(name, (0.0, 0.0))
                local[name] = (pv + v, pw + w)
    # Every rank needs the same names in the same order: take them from the first contributing rank.
    source = torch.tensor([layout.rank if contributes else layout.world_size], dtype=torch.int64, device=_device())
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    names = [sorted(local)]
    dist.broadcast_object_list(names, src=int(source.item()))
    keys = names[0]
    sums = torch.tensor(
        [[local.get(k, (0.0, 0.0))[0], local.get(k, (0.0, 0.0))[1]] for k in keys if not k.endswith("_max")],
        dtype=torch.float64,
        device=_device(),
    ).reshape(-1, 2)
    maxes = torch.tensor(
        [local.get(k, (float("-inf"), 1.0))[0] for k in keys if k.endswith("_max")],
        dtype=torch.float64,
        device=_device(),
    )
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    out: dict[str, float] = {}
    for k, (s, w) in zip([k for k in keys if not k.endswith("_max")], sums.cpu().tolist()):
        if k.endswith("_total"):
            out[prefix + k] = s
        else:
            out[prefix + k] = s / w if w > 0 else 0.0
    for k, v in zip([k for k in keys if k.endswith("_max")], maxes.cpu().tolist()):
        out[prefix + k] = v
    return out


def explained_variance(metrics: dict[str, float], stem: str, key: str) -> dict[str, float]:
    """Replace the `<stem>*_total` sums (learner/step.py ev_totals) by the step's explained variance under `key` (1
    when Var(R) = 0 and Var(R - V) = 0, 0 when only Var(R) = 0, as algo.explained_variance does); in place."""
    totals = {k: metrics.pop(f"{stem}{k}_total", 0.0) for k in ("n", "r", "r2", "e", "e2")}
    n = totals["n"]
    if n <= 0:
        return metrics
    var_r = totals["r2"] / n - (totals["r"] / n) ** 2
    var_e = totals["e2"] / n - (totals["e"] / n) ** 2
    if var_r <= 1e-12:
        ev = 1.0 if var_e <= 1e-12 else 0.0
    else:
        ev = 1.0 - var_e / var_r
    metrics[key] = ev
    return metrics


def all_reduce_scalar(value: float, op: str = "sum", group: object | None = None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(
        t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], group=group
    )
    return float(t.item())
