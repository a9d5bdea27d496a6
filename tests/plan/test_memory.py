"""The planner's memory against what tiny megatron models hold on CPU: parameter, gradient-buffer and optimizer-state
bytes (exact), and the activations autograd saves during one micro-batch (the planner's per-layer account, within
the stated error), for the policy and the critic of each family; full recomputation keeps the same gradients and
drops the saved activations as planned -- the critic's first-layer MLPs included, whose gradient a reentrant
checkpoint over a frozen embedding would silently drop (learner/roles.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.distributed import spawn_ranks
from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.families import detect_family
from megatron_sao.plan.measure import measure_roles
from megatron_sao.plan.memory import Layout, role_memory
from megatron_sao.plan.tensors import Architecture
from tests.plan.conftest import FAMILIES

TOKENS = 96
ACTIVATION_ERROR = 0.25
"""The stated error of the activation account on these models (docs/scaling.md has the measured figures)."""


def planned(hf_dir: Path, role: str, tokens: int, recompute: str) -> Any:
    hf = json.loads((hf_dir / "config.json").read_text())
    arch = Architecture.from_spec(ModelSpec(family=detect_family(hf, None), hf=hf, dtype="fp32"))
    layout = Layout.of(ParallelConfig(), 1, arch.num_layers)
    return role_memory(arch, role, layout, 0, dtype="fp32", distributed_optimizer=True, tokens=tokens,
                       recompute=recompute, flash_attention=False, te_layout=False)  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # fmt: skip
def test_memory_matches_measured(tiny: dict[str, Path], family: str) -> None:
    (none,) = spawn_ranks(measure_roles, 1, str(tiny[family]), TOKENS, "none")
    (full,) = spawn_ranks(measure_roles, 1, str(tiny[family]), TOKENS, "full")
    for role in ("policy", "value"):
        plan = planned(tiny[family], role, TOKENS, "none")
        got = none[role]
        assert got["ok"]
        assert plan.weights <= got["weights"] <= plan.weights * 1.02 + 4096, role
        # megatron pads each gradient bucket (and the optimizer's shards) to a multiple of its DP alignment
        assert plan.grads <= got["grads"] <= plan.grads * 1.02 + 4096, role
        assert plan.optimizer <= got["optimizer"] <= plan.optimizer * 1.02 + 4096, role
        assert abs(got["activations"] - plan.activations.saved) <= ACTIVATION_ERROR * got["activations"], (
            role,
            got,
            plan,
        )
        # full recomputation: the same step, a fraction of the saved bytes, as planned
        assert full[role]["grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-5), role
        plan_full = planned(tiny[family], role, TOKENS, "full")
        assert full[role]["activations"] < 0.7 * got["activations"], role
        assert (
            abs(full[role]["activations"] - plan_full.activations.saved) <= ACTIVATION_ERROR * full[role]["activations"]
        )
