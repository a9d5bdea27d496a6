"""Tiny randomly initialized Hugging Face models of each supported family, with a small tokenizer.

The project ships no weights: tests, benchmarks and the CPU examples make their models with
`make_tiny_model()` (CLI: tools/make_tiny_model.py), using transformers' own config and model classes so
that everything downstream (engine, conversion, learner) sees a genuine HF checkpoint directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models.families import FAMILIES as REGISTRY

FAMILIES = tuple(REGISTRY)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "What is 12 + 7? Use the calculator: <tool_call>12 + 7</tool_call> <tool_response>19</tool_response> "
    "The answer is <answer>19</answer>.",
    "Compute (3 * 4) - 5 and answer with a number.",
    "Write one short sentence about the sea in a cute style, a chuunibyou style or a classical style.",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / ( ) = ? !",
    "user assistant system tool observation answer result question step think",
]


def _tiny_hf_config(
    family: str, vocab_size: int, layers: int, hidden: int, experts: int, topk: int, tie_embeddings: bool
) -> Any:
    import transformers

    heads = max(2, hidden // 16)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_experts_per_tok=topk,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=[SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")],
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=heads // 2, head_dim=16, num_experts=experts, norm_topk_prob=True
        )
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common,
            num_key_value_heads=heads // 2,
            head_dim=16,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            attention_bias=True,
            partial_rotary_factor=0.5,
            routed_scaling_factor=2.5,
        )
    if family == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig(
            **common,
            num_key_value_heads=heads,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=256,  # >= test sequence lengths: dense MLA is then exact (see families/glm_moe_dsa.py)
            index_head_dim=16,
            index_n_heads=2,
        )
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=heads // 2, head_dim=16)
    if family == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=heads // 2, head_dim=hidden // heads)
    raise ValueError(f"unsupported family {family!r}; supported: {', '.join(FAMILIES)}")


def _perturb(model: Any, init_std: float | None) -> None:
    """Non-zero expert biases (always: conversions that drop them are caught); with `init_std`, norms and
    biases away from their 1 / 0 initialization."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.01)
            elif init_std is not None and name.endswith("norm.weight"):
                t.copy_(1.0 + torch.randn_like(t) * init_std)
            elif init_std is not None and name.endswith(".bias"):
                t.copy_(torch.randn_like(t) * init_std)


def _to_bf16(model: Any) -> None:
    """Cast to bf16 except the modules transformers keeps in fp32 in bf16 checkpoints (`_keep_in_fp32_modules_strict`,
    e.g. GLM's router weight and expert bias)."""
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                full = f"{module_name}.{name}" if module_name else name
                if t.is_floating_point() and not any(k in full for k in keep):
                    t.data = t.data.to(torch.bfloat16)


def build_tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in corpus, with chat and tool special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    family: str,
    out: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    experts: int = 4,
    topk: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "fp32",
    tokenizer: bool = True,
    force: bool = False,
    init_std: float | None = None,
    tie_embeddings: bool = False,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random HF model of `family` (safetensors, config.json, tokenizer files) to `out`.

    `init_std` (None: transformers' 0.02) is the weights' standard deviation; when given, norm weights become
    1 + N(0, init_std) and biases N(0, init_std) too, so logits are far from zero and a swapped or dropped tensor
    changes them (a parity check against transformers is then meaningful). bf16 models keep the tensors that
    transformers keeps in fp32 (e.g. the sigmoid router and its expert bias) in fp32, as real checkpoints do.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty; pass force=True (--force) to overwrite it")
        shutil.rmtree(out)
    if hidden % 16:
        raise ValueError(f"hidden={hidden} must be a multiple of 16 (16-dim heads)")
    if topk > experts:
        raise ValueError(f"topk={topk} exceeds experts={experts}")
    if init_std is not None and not init_std > 0:
        raise ValueError(f"init_std={init_std} must be positive")
    config = _tiny_hf_config(family, vocab_size, layers, hidden, experts, topk, tie_embeddings)
    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, init_std)
    if dtype == "bf16":
        _to_bf16(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        tok = build_tiny_tokenizer()
        if len(tok) > vocab_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} tokens)")
        tok.save_pretrained(out)
    meta = {
        "family": family,
        "seed": seed,
        "layers": layers,
        "hidden": hidden,
        "experts": experts,
        "topk": topk,
        "init_std": init_std,
        "tie_embeddings": tie_embeddings,
    }
    (out / "tiny_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def make_configured(model: Any) -> Path | None:
    """`model.make_tiny` (config/model.py): make the tiny model at model.hf_path when nothing is there yet; its
    path, or None when there was nothing to make."""
    spec = model.make_tiny
    if spec is None or model.hf_path is None or (Path(model.hf_path) / "config.json").is_file():
        return None
    print(f"[model] making a tiny random {model.family} at {model.hf_path} (model.make_tiny)", flush=True)
    return Path(make_tiny_model(model.family, model.hf_path, layers=spec.layers, hidden=spec.hidden,
                                experts=spec.experts, seed=spec.seed, force=True))  # fmt: skip
