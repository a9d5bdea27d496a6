"""Per-token log-probs and values of packed trajectories: TP=2 (SP), EP=2 and PP=2 equal TP=1, and TP=1
equals transformers on the unpacked sequences."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.config import ParallelConfig
from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch

LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2_sp": ParallelConfig(tensor=2),
    "ep2": ParallelConfig(expert=2),
    "pp2": ParallelConfig(pipeline=2),
}


def _fixed_value_head(model) -> None:
    """Same head weights in every layout (the head is replicated, so the full tensor is set)."""
    head = model.output_layer
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.1)
        head.bias.fill_(0.25)


def _outputs_per_layout(hf_dir: str, dtype: str) -> dict:
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.forward import collect_logprobs, collect_values
    from megatron_sao.learner.packing import pack_microbatches
    from megatron_sao.models.builder import ModelSpec, build_model, transformer_config
    from megatron_sao.models.weights import HFCheckpoint, load_hf_weights

    spec = ModelSpec.from_hf_dir(hf_dir, dtype=dtype)
    batch = make_step_batch(make_batch(5), max_seq_len=4096)
    out = {}
    for name, parallel in LAYOUTS.items():
        ctx = init_distributed(parallel, seed=3)
        policy = build_model(spec, transformer_config(spec, parallel))
        load_hf_weights(policy, spec, HFCheckpoint(hf_dir))
        value = build_model(spec, transformer_config(spec, parallel), role="value")
        load_hf_weights(value, spec, HFCheckpoint(hf_dir), role="value")
        if hasattr(value, "output_layer"):
            _fixed_value_head(value)
        # budget 40 tokens: several micro-batches, some packing two trajectories
        mbs = pack_microbatches(batch, max_tokens=40, pad_multiple=parallel.tensor, use_thd=False)
        logp = torch.zeros_like(batch.rollout_logprobs)
        values = torch.zeros_like(batch.rollout_logprobs)
        with torch.no_grad():
            has_logp = collect_logprobs(
                policy, mbs, logp, temperature=0.7, vocab_size=spec.vocab_size, tp_rank=ctx.tp_rank
            )
            has_values = collect_values(value, mbs, values)
        out[name] = (logp, values) if has_logp and has_values else None
        out[f"{name}_microbatches"] = len(mbs)
        destroy_distributed(keep_process_group=True)
    return out


def _hf_logprobs(hf_dir: str, temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from megatron_sao.learner.batch import make_step_batch

    batch = make_step_batch(make_batch(5), max_seq_len=4096)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = torch.zeros_like(batch.rollout_logprobs)
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            logits = model(toks.view(1, -1)).logits[0, :-1] / temperature
            ref[i, : toks.numel() - 1] = torch.log_softmax(logits, -1).gather(1, toks[1:].view(-1, 1)).view(-1)
    return ref


@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_logprobs_and_values_match_across_layouts_and_transformers(tiny_hf_dir, family):
    hf_dir = tiny_hf_dir(family)
    per_rank = spawn_ranks(_outputs_per_layout, 2, str(hf_dir), "fp32", timeout_s=400)
    ref_logp, ref_values = per_rank[0]["tp1"]
    assert per_rank[0]["tp1_microbatches"] >= 3
    hf = _hf_logprobs(str(hf_dir), temperature=0.7)
    assert torch.allclose(ref_logp, hf, atol=1e-5), (ref_logp - hf).abs().max()
    assert ref_values.abs().sum() > 0
    for name in ["tp2_sp", "ep2"]:
        for rank in range(2):
            logp, values = per_rank[rank][name]
            assert torch.allclose(logp, ref_logp, atol=1e-5), (name, (logp - ref_logp).abs().max())
            assert torch.allclose(values, ref_values, atol=1e-5), (name, (values - ref_values).abs().max())
    assert per_rank[0]["pp2"] is None  # first stage: no outputs
    logp, values = per_rank[1]["pp2"]
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(values, ref_values, atol=1e-5)


def test_a_microbatch_whose_eager_attention_cannot_fit_is_named_with_the_field_and_a_size_that_fits() -> None:
    """The local spec's [heads, S, S] scores per layer (SmolLM2: 30 x 9 at 4096 tokens, about 17 GiB) were killed by
    the OOM killer without a word; now the learner warns at start-up past half the free memory."""
    from megatron_sao.learner.packing import check_eager_attention_memory

    gib = 2**30
    assert check_eager_attention_memory(1024, 30, 9, ParallelConfig(), available=21 * gib, ranks=1) is None
    warned = check_eager_attention_memory(4096, 30, 9, ParallelConfig(), available=21 * gib, ranks=1)
    assert warned and "16.9 GiB" in warned and "set learner.max_tokens_per_microbatch to 3072 or less" in warned
    # pipeline stages hold fewer layers and tensor parallel ranks fewer heads; two ranks on one machine share it
    assert check_eager_attention_memory(4096, 30, 9, ParallelConfig(pipeline=2, tensor=3), 21 * gib, 1) is None
    assert check_eager_attention_memory(3072, 30, 9, ParallelConfig(), available=21 * gib, ranks=2)
