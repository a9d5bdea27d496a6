#!/usr/bin/env python
"""How far to trust `python -m megatron_sao plan`: its numbers side by side with (1) the HF model cards' parameter
counts, (2) Megatron-LM's own theoretical memory estimate (megatron/training/theoretical_memory_usage.py, which the
megatron-core wheel does not ship: pass a Megatron-LM checkout or the file) for the two examples' policy, and (3)
what tiny megatron models of each family really hold on this CPU (parameters, gradient buffers and optimizer state
by storage, the activations autograd saves for one micro-batch, without and with full recompute).

python benchmarks/plan_check.py [--megatron-lm PATH] [--tokens 96] [--out docs/results/plan_check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_sao.config import load_config  # noqa: E402
from megatron_sao.config.parallel import ParallelConfig  # noqa: E402
from megatron_sao.distributed import spawn_ranks  # noqa: E402
from megatron_sao.models.builder import ModelSpec, padded_vocab_size  # noqa: E402
from megatron_sao.models.families import detect_family  # noqa: E402
from megatron_sao.models.tiny import make_tiny_model  # noqa: E402
from megatron_sao.plan.measure import measure_roles  # noqa: E402
from megatron_sao.plan.memory import GB, Layout, role_memory  # noqa: E402
from megatron_sao.plan.plan import Hardware, make_plan  # noqa: E402
from megatron_sao.plan.tensors import Architecture, hf_counts  # noqa: E402

EXAMPLES = {"qwen3_30b": (6, None, (30.5, 3.3)), "glm_750b": (96, 141.0, (744.0, 40.0))}
FAMILIES = ("qwen3_moe", "glm4_moe", "glm_moe_dsa")


def arch_of(hf: dict[str, Any], dtype: str = "bf16") -> Architecture:
    return Architecture.from_spec(ModelSpec(family=detect_family(hf, None), hf=hf, dtype=dtype))


def load_megatron_estimate(path: Path) -> types.ModuleType:
    """theoretical_memory_usage.py as a module (its one relative import, print helpers, stubbed)."""
    if path.is_dir():
        path = path / "megatron" / "training" / "theoretical_memory_usage.py"
    source = path.read_text().replace("from .utils import is_hybrid_model, print_rank_0", "")
    module = types.ModuleType("theoretical_memory_usage")
    module.__dict__.update(print_rank_0=print, is_hybrid_model=lambda args: False)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def megatron_args(arch: Architecture, cfg: Any, layout: Layout, tokens: int) -> types.SimpleNamespace:
    m = arch.mla or {}
    return types.SimpleNamespace(
        kv_channels=arch.head_dim, num_attention_heads=arch.heads, hidden_size=arch.hidden,
        group_query_attention=arch.mla is None and arch.kv_heads != arch.heads, num_query_groups=arch.kv_heads,
        num_experts=arch.experts or None, swiglu=True, moe_shared_expert_intermediate_size=arch.shared_ffn or None,
        moe_layer_freq=list(arch.moe_layers), num_layers=arch.num_layers, moe_ffn_hidden_size=arch.moe_ffn,
        mtp_num_layers=None, normalization="RMSNorm", multi_latent_attention=arch.mla is not None,
        q_lora_rank=m.get("q_lora_rank") or None, qk_head_dim=m.get("qk_head_dim"),
        qk_pos_emb_head_dim=m.get("qk_pos_emb_head_dim"), kv_lora_rank=m.get("kv_lora_rank"),
        v_head_dim=m.get("v_head_dim"), padded_vocab_size=padded_vocab_size(arch.vocab, layout.tp),
        untie_embeddings_and_output_weights=not arch.tied, ffn_hidden_size=arch.ffn, moe_latent_size=None,
        moe_router_topk=arch.topk, add_bias_linear=False, moe_shared_expert_gate=False,
        expert_tensor_parallel_size=layout.etp, expert_model_parallel_size=layout.ep,
        pipeline_model_parallel_size=layout.pp, tensor_model_parallel_size=layout.tp, world_size=cfg.launch
        .learner_world_size, use_distributed_optimizer=cfg.learner.use_distributed_optimizer,
        data_parallel_size=layout.dp, seq_length=tokens, micro_batch_size=1, virtual_pipeline_model_parallel_size=None,
    )  # fmt: skip


def check_examples(megatron: types.ModuleType | None) -> list[dict[str, Any]]:
    rows = []
    for name, (nodes, engine_mem, card) in EXAMPLES.items():
        cfg = load_config(REPO / "examples" / name / "config.yaml")
        hf = json.loads((REPO / "examples" / name / "hf_config.json").read_text())
        arch = arch_of(hf)
        counts = hf_counts(arch)
        plan = make_plan(cfg, hf, Hardware(nodes=nodes, engine_gpu_mem_gb=engine_mem))
        layout = plan.layout
        assert layout is not None
        tokens = cfg.learner.max_tokens_per_microbatch
        # megatron's estimate: everything trainable, most loaded shard = embedding + num_layers / PP layers
        ours = [role_memory(arch, "policy", layout, s, dtype="bf16", distributed_optimizer=True, tokens=tokens,
                            recompute="selective", microbatches=1) for s in range(layout.pp)]  # fmt: skip
        row: dict[str, Any] = {
            "example": name, "fits": plan.fits, "total_B": counts.total / 1e9, "active_B": counts.active / 1e9,
            "active_without_embeddings_B": counts.active_without_embeddings / 1e9, "card_B": card,
            "worst_stage_GB": plan.worst_stage.total / GB if plan.worst_stage else None,
            "policy_static_stage0_GB": ours[0].static / GB, "policy_static_max_GB": max(m.static for m in ours) / GB,
            "policy_activations_selective_stage0_GB": ours[0].activations.saved / GB,
        }  # fmt: skip
        if megatron is not None:
            args = megatron_args(arch, cfg, layout, tokens)
            row["megatron_weights_and_optimizer_GB"] = megatron.compute_weight_and_optimizer_memory(args) / GB
            row["megatron_activations_GB"] = megatron.compute_activation_memory(args, num_microbatches=1) / GB
        rows.append(row)
    return rows


def check_tiny(tokens: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            hf_dir = make_tiny_model(family, Path(tmp) / family, layers=3, seed=2, tokenizer=False)
            hf = json.loads((hf_dir / "config.json").read_text())
            arch = arch_of(hf, "fp32")
            layout = Layout.of(ParallelConfig(), 1, arch.num_layers)
            for recompute in ("none", "full"):
                (got,) = spawn_ranks(measure_roles, 1, str(hf_dir), tokens, recompute)
                for role in ("policy", "value"):
                    plan = role_memory(arch, role, layout, 0, dtype="fp32", distributed_optimizer=True, tokens=tokens,
                                       recompute=recompute, flash_attention=False, te_layout=False)  # fmt: skip
                    g = got[role]
                    rows.append({
                        "family": family, "role": role, "recompute": recompute,
                        "static_planned": plan.static, "static_measured": g["weights"] + g["grads"] + g["optimizer"],
                        "activations_planned": plan.activations.saved, "activations_measured": g["activations"],
                    })  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", type=Path, default=None, help="Megatron-LM checkout or theoretical_memory_usage.py")
    p.add_argument("--tokens", type=int, default=96, help="tokens of the tiny models' micro-batch")
    p.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    args = p.parse_args()
    megatron = load_megatron_estimate(args.megatron_lm) if args.megatron_lm else None
    examples = check_examples(megatron)
    print("example      params (card)     active (card)  worst stage  policy w+g+o stage 0 / max  megatron's w+g+o  "
          "policy acts (selective)  megatron's acts")  # fmt: skip
    for r in examples:
        mw = r.get("megatron_weights_and_optimizer_GB")
        ma = r.get("megatron_activations_GB")
        active = r["active_B"] if r["example"] == "qwen3_30b" else r["active_without_embeddings_B"]
        mw_s = "-" if mw is None else f"{mw:6.1f} GB"
        ma_s = "-" if ma is None else f"{ma:.1f} GB"
        stage0, most = r["policy_static_stage0_GB"], r["policy_static_max_GB"]
        print(f"{r['example']:<12} {r['total_B']:6.1f}B ({r['card_B'][0]:g}B)  {active:5.1f}B ({r['card_B'][1]:g}B)  "
              f"{r['worst_stage_GB']:6.1f} GB   {stage0:6.1f} / {most:.1f} GB          {mw_s}         "
              f"{r['policy_activations_selective_stage0_GB']:6.1f} GB                {ma_s}")  # fmt: skip
    tiny = check_tiny(args.tokens)
    print(f"\ntiny models on CPU (fp32, 3 layers, {args.tokens}-token micro-batch): planned vs measured bytes")
    print("family       role    recompute  static planned / measured (error)   activations planned / measured (error)")
    for r in tiny:
        se = r["static_planned"] / r["static_measured"] - 1
        ae = r["activations_planned"] / r["activations_measured"] - 1
        print(f"{r['family']:<12} {r['role']:<7} {r['recompute']:<9}  {r['static_planned']:>9,.0f} / "
              f"{r['static_measured']:>9,.0f} ({se:+.2%})       {r['activations_planned']:>9,.0f} / "
              f"{r['activations_measured']:>9,.0f} ({ae:+.1%})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"examples": examples, "tiny": tiny}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
