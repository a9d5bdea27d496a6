"""Build this rank's megatron-core GPTModel (policy or value role) from an HF config.json.

Called by the learner, the conversion/parity tools and tests. Layer specs come from megatron-core
(`get_gpt_decoder_block_spec`): Transformer Engine specs for bf16 models when megatron-core can use TE on a
GPU (uses_transformer_engine), local specs otherwise (the CPU path, and fp32 on GPUs). The value role is the
same backbone with `ValueHead` as output layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_sao.config.model import ModelConfig, read_hf_config_json
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.models.families import HFConfig, ModelFamily, UnsupportedModelError, detect_family

logger = logging.getLogger(__name__)

Role = Literal["policy", "value"]
DSA_UNAVAILABLE = (
    "model.use_dsa_indexer=true is not available: megatron-core 0.16's DSA module (experimental_attention_variant"
    "='dsa') cannot run here and does not match transformers' GLM-5 indexer: (1) DSAIndexer rotates q/k with "
    "fast_hadamard_transform.hadamard_transform, a CUDA-only extension that also requires bf16 inputs, while "
    "transformers' GlmMoeDsaIndexer applies no Hadamard rotation; (2) its layer spec takes the fused q/kv "
    "up-projections from backend.column_parallel_layer_norm_linear(), which is None without Transformer Engine. "
    "Set model.use_dsa_indexer=false: dense MLA is exact for sequences up to config.json's index_topk, and the "
    "indexer weights travel through checkpoints unchanged (docs/models.md)"
)
ROPE_MODEL_ARGS = ("rotary_base", "rotary_percent")
VOCAB_PAD_MULTIPLE = 128


def transformer_engine_available() -> bool:
    """Whether megatron-core can use Transformer Engine here: CUDA, TE's PyTorch module, and megatron's TE layer
    specs enabled (`import transformer_engine` alone succeeds when `transformer_engine.pytorch` fails to import, e.g.
    a TE built for another torch or too new for this megatron-core; megatron then has HAVE_TE=False)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.models.gpt import gpt_layer_specs
    except ImportError:
        return False
    if not getattr(gpt_layer_specs, "HAVE_TE", False):
        logger.warning("transformer_engine imports but megatron-core cannot use it (HAVE_TE=False): local layer specs")
        return False
    return True


def uses_transformer_engine(spec: ModelSpec) -> bool:
    """The one decision between TE layer specs with THD-packed sequences and the local spec with a block-causal
    mask. TE attention on THD needs bf16/fp16 (FlashAttention / FusedAttention; TE <= 2.10 has no unfused THD
    backend), so an fp32 model uses the local spec on GPUs too."""
    return spec.dtype == "bf16" and transformer_engine_available()


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Embedding rows megatron holds: a multiple of 128 (and of TP). Rows past `vocab_size` are padding that
    the policy's log-softmax masks out; checkpoints keep the padded size, which does not depend on TP for any
    TP dividing 128."""
    multiple = VOCAB_PAD_MULTIPLE
    padded = -(-vocab_size // multiple) * multiple
    if padded % tensor_parallel:
        multiple = VOCAB_PAD_MULTIPLE * tensor_parallel
        padded = -(-vocab_size // multiple) * multiple
    return padded


@dataclass(frozen=True)
class ModelSpec:
    """Everything that fixes the network's shape and numerics (not its parallel layout)."""

    family: ModelFamily
    hf: HFConfig
    dtype: Literal["bf16", "fp32"] = "fp32"
    use_dsa_indexer: bool = False
    max_seq_len: int = 4096

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    @classmethod
    def from_hf_dir(cls, path: str | Path, **kwargs: Any) -> ModelSpec:
        hf = read_hf_config_json(path)
        overrides = kwargs.pop("hf_overrides", None) or {}
        hf.update(overrides)
        return cls(family=detect_family(hf, kwargs.pop("family", None)), hf=hf, **kwargs)

    @classmethod
    def from_config(cls, model: ModelConfig) -> ModelSpec:
        hf = model.hf_config_dict()
        if hf is None:
            raise ValueError(f"model.hf_path={model.hf_path!r} has no config.json; point it at an HF model directory")
        return cls(
            family=detect_family(hf, model.family),
            hf=hf,
            dtype=model.dtype,
            use_dsa_indexer=model.use_dsa_indexer,
            max_seq_len=model.max_seq_len,
        )


def numerics(dtype: str, use_te: bool, rope_fusion: bool = True) -> dict[str, Any]:
    """dtype and kernel-fusion settings of a TransformerConfig: fusions need TE/apex/CUDA kernels.
    `rope_fusion=False` where megatron has no fused kernel for the model's RoPE (MLA without YaRN)."""
    from megatron.core.tensor_parallel.layers import _grad_accum_fusion_available

    params_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return dict(
        bf16=dtype == "bf16",
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fusions need TE/apex/CUDA kernels; the CPU path runs the eager functions.
        # apex's fused_weight_gradient_mlp_cuda (not in TE): megatron's output layer refuses the flag without it
        gradient_accumulation_fusion=use_te and _grad_accum_fusion_available,
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        apply_rope_fusion=use_te and rope_fusion,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        moe_grouped_gemm=use_te,
    )


def recompute_settings(mode: str) -> dict[str, Any]:
    """TransformerConfig fields of `learner.recompute` (none, selective, full)."""
    if mode == "selective":
        return dict(recompute_granularity="selective")
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def transformer_config(
    spec: ModelSpec,
    parallel: ParallelConfig,
    *,
    use_te: bool | None = None,
    moe_aux_loss_coeff: float = 0.0,
    **overrides: Any,
) -> Any:
    """megatron-core TransformerConfig (MLATransformerConfig for MLA families) for `spec` laid out by `parallel`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    use_te = uses_transformer_engine(spec) if use_te is None else use_te
    arch = spec.family.architecture(spec.hf)
    # MLATransformerConfig: "apply_rope_fusion for MLA only works with YARN RoPE"
    rope_fusion = not spec.family.multi_latent_attention or arch.get("rope_type") == "yarn"
    if not spec.family.multi_latent_attention:
        for key in ROPE_MODEL_ARGS:  # GPTModel arguments, not TransformerConfig fields (MLA keeps them)
            arch.pop(key)
    if not spec.use_dsa_indexer:
        for key in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            arch.pop(key, None)
    parallel.check_num_experts(arch.get("num_moe_experts") or 0)
    heads, groups = arch["num_attention_heads"], arch.get("num_query_groups") or arch["num_attention_heads"]
    if heads % parallel.tensor or groups % parallel.tensor:
        raise ValueError(
            f"parallel.tensor={parallel.tensor} must divide the {heads} attention heads and {groups} KV heads of "
            f"{spec.family.name}; choose a tensor-parallel size that divides both"
        )
    first_stage_layers, last_stage_layers = parallel.stage_layers(arch["num_layers"])
    kwargs: dict[str, Any] = dict(
        **arch,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(spec.hf.get("initializer_range", 0.02)),
        **parallel.megatron_sizes(),
        sequence_parallel=parallel.use_sequence_parallel,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
        moe_router_bias_update_rate=0.0,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        **numerics(spec.dtype, use_te, rope_fusion),
    )
    if spec.use_dsa_indexer:
        kwargs["experimental_attention_variant"] = "dsa"
    kwargs.update(overrides)
    cls = MLATransformerConfig if spec.family.multi_latent_attention else TransformerConfig
    return cls(**kwargs)


def build_model(
    spec: ModelSpec,
    config: Any,
    role: Role = "policy",
    *,
    use_te: bool | None = None,
    vp_stage: int | None = None,
) -> Any:
    """This pipeline stage's GPTModel. Weights are randomly initialized; load them with models.weights.
    The value role's head starts at zero (models/value_head.py), identical at every layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_sao.models.attention import with_latent_attention
    from megatron_sao.models.value_head import ValueHead

    use_te = uses_transformer_engine(spec) if use_te is None else use_te
    if spec.use_dsa_indexer:
        raise UnsupportedModelError(DSA_UNAVAILABLE)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if spec.family.multi_latent_attention and not use_te:
        block = with_latent_attention(block, spec.family.mla_latent_norm_eps)
    rope = {k: v for k, v in spec.family.architecture(spec.hf).items() if k in ROPE_MODEL_ARGS}
    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=spec.max_seq_len,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=spec.tie_embeddings and role == "policy",
        position_embedding_type="rope",
        rotary_percent=float(rope["rotary_percent"]),
        rotary_base=int(rope["rotary_base"]),
        vp_stage=vp_stage,
    )
    if role == "value" and post:
        model.output_layer = ValueHead(config)
    return model
