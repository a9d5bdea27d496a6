"""examples/smollm2_tools as `./launch.sh smollm2` runs it, short of the 30-minute run (which docs its numbers in the
example's README): the config is valid, its trainable patterns pick SmolLM2's top four layers (global numbering)
for the policy and their MLPs and the head for the critic, its environment gives two worked calculator examples,
and its micro-batch is one the learner does not warn about on this machine."""

from __future__ import annotations

from megatron_sao.config import load_config
from megatron_sao.learner.packing import check_eager_attention_memory
from megatron_sao.learner.roles import layer_selective, trains
from megatron_sao.rollout.envs import make_env

CONFIG = "examples/smollm2_tools/config.yaml"
SMOLLM2_LAYERS, SMOLLM2_HEADS = 30, 9


def test_the_smollm2_example_trains_the_top_layers_with_worked_examples_in_the_prompt() -> None:
    cfg = load_config(CONFIG, [])
    assert cfg.model.family == "llama" and cfg.algo.name == "sao" and cfg.rollout.env.name == "arithmetic"
    policy, value = cfg.learner.policy, cfg.learner.value
    for layer in range(SMOLLM2_LAYERS):
        top, qkv = layer >= SMOLLM2_LAYERS - 4, f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
        assert trains(qkv, policy.trainable, policy.frozen) == top
        assert trains(f"decoder.layers.{layer}.mlp.linear_fc1.weight", value.trainable, value.frozen) == top
        assert not trains(qkv, value.trainable, value.frozen)
    assert trains("output_layer.weight", value.trainable, value.frozen)
    assert not trains("embedding.word_embeddings.weight", policy.trainable, policy.frozen)  # tied to the output
    assert layer_selective("mlp.linear_fc1.weight", SMOLLM2_LAYERS, policy.trainable, policy.frozen)
    env = make_env(cfg.rollout.env.name, cfg.rollout.env.options)
    (prompt,) = env.make_prompts(1, seed=0)
    assert [m["role"] for m in env.start(prompt).messages].count("tool") == 2
    assert check_eager_attention_memory(cfg.learner.max_tokens_per_microbatch, SMOLLM2_LAYERS, SMOLLM2_HEADS,
                                        cfg.parallel, available=16 * 2**30, ranks=1) is None  # fmt: skip
