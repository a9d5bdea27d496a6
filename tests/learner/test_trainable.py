"""The critic's default trainable set (SAO's frozen-attention critic): every MLP and the value head train;
attention, router, norms and embeddings stay frozen. Checked on all three families, whose layers differ
(glm4_moe and glm_moe_dsa start with a dense MLP layer; GLM has shared experts)."""

from __future__ import annotations

import fnmatch

import pytest

from megatron_sao.config import ParallelConfig
from megatron_sao.config.learner import ValueOptimConfig
from megatron_sao.distributed import spawn_ranks

FROZEN_PARTS = (".self_attention.", ".router.", "norm", "embedding.")


def _value_parameter_names(hf_dir: str) -> list[tuple[str, bool]]:
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.roles import select_trainable
    from megatron_sao.models.builder import ModelSpec, build_model, transformer_config

    spec = ModelSpec.from_hf_dir(hf_dir)
    init_distributed(ParallelConfig(), seed=0)
    model = build_model(spec, transformer_config(spec, ParallelConfig()), role="value")
    optim = ValueOptimConfig()
    select_trainable(model, optim.trainable, optim.frozen)
    names = [(n, p.requires_grad) for n, p in model.named_parameters()]
    destroy_distributed()
    return names


@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "glm_moe_dsa"])
def test_value_role_trains_every_mlp_and_the_head_and_nothing_else(tiny_hf_dir, family: str) -> None:
    (names,) = spawn_ranks(_value_parameter_names, 1, str(tiny_hf_dir(family)))
    for name, trainable in names:
        expected = (".mlp." in name or name.startswith("output_layer.")) and not any(
            part in name for part in FROZEN_PARTS
        )
        assert trainable == expected, f"{family}: {name} trainable={trainable}, expected {expected}"
    if family != "qwen3_moe":  # the leading dense layer's MLP is what the old default left frozen
        dense = [n for n, t in names if fnmatch.fnmatchcase(n, "*.mlp.linear_fc*")]
        assert dense and all(t for n, t in names if n in dense)
