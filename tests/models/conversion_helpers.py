"""Helpers of the conversion tests: HF directory edits, loading a tools/ CLI, and the functions run on spawned
ranks (megatron on CPU patches the process it runs in, so the pytest process itself never builds megatron
models). Module-level so `spawn_ranks` can import them."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megatron_sao.config.parallel import ParallelConfig

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"sao_tool_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def edit_tensors(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of a single-file HF model directory with `edit(tensors: dict)` applied to its weights."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


MULTI_RANK_LAYOUTS = {
    "tp2": ParallelConfig(tensor=2),
    "ep2": ParallelConfig(expert=2),
    "pp2": ParallelConfig(pipeline=2),
    "tp2nosp": ParallelConfig(tensor=2, sequence_parallel=False),
}


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _read_all(ckpt: str) -> tuple[dict[str, torch.Tensor], dict]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_sao.models.checkpoint import read_hf_source

    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(v.global_shape, dtype=v.dtype), replica_id=0)
        for k, v in meta.items()
    }
    loaded = dist_checkpointing.load(request, ckpt)  # also holds the common entries (hf_source)
    return {k: loaded[k] for k in request}, read_hf_source(ckpt)


def _write_variant(src: str, dst: str, edit: Any, keep_record: bool = True) -> str:
    """A copy of checkpoint `src` (whole tensors, same keys, hf_source record unless not `keep_record`) with
    `edit(tensors)` applied."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_sao.models.checkpoint import HF_SOURCE_KEY

    tensors, record = _read_all(src)
    edit(tensors)
    Path(dst).mkdir(parents=True)
    state: dict[str, Any] = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    if keep_record:
        state[HF_SOURCE_KEY] = record
    dist_checkpointing.save(state, dst)
    return dst


def _bad_checkpoints(ckpt: str, hf: str, other_config_hf: str, root: Path) -> dict[str, str]:
    """Each bad megatron checkpoint / config, converted back to HF: the error it raises (or 'no error')."""
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf

    def drop(t: dict) -> None:
        del t["policy.decoder.layers.1.mlp.router.weight"]

    def extra(t: dict) -> None:
        t["policy.decoder.layers.0.self_attention.extra_proj.weight"] = torch.zeros(4, 4)

    def reshape(t: dict) -> None:
        t["policy.decoder.final_layernorm.weight"] = torch.ones(t["policy.decoder.final_layernorm.weight"].numel() + 1)

    def retype(t: dict) -> None:
        key = "policy.decoder.layers.0.self_attention.linear_proj.weight"
        t[key] = t[key].to(torch.bfloat16)

    out = {}
    for case, edit in {"missing": drop, "unexpected": extra, "shape": reshape, "dtype": retype}.items():
        variant = _write_variant(ckpt, str(root / f"bad_{case}"), edit)
        out[f"ckpt_{case}"] = _error(
            lambda v=variant, c=case: convert_megatron_to_hf(v, root / f"o_{c}", hf, progress=False)
        )
    unrecorded = _write_variant(ckpt, str(root / "no_record"), lambda t: None, keep_record=False)
    out["no_record"] = _error(lambda: convert_megatron_to_hf(unrecorded, root / "back_no_record", hf, progress=False))
    out["ckpt_other_config"] = _error(
        lambda: convert_megatron_to_hf(ckpt, root / "o_other", other_config_hf, progress=False)
    )
    return out


def _local_spec_keys(hf_dirs: dict[str, str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The raw (not canonicalized) checkpoint keys a local-spec model of each family emits, with the leading
    indices of stacked tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_sao.convert.common import one_process_megatron
    from megatron_sao.models.builder import ModelSpec, build_model, transformer_config

    out = {}
    with one_process_megatron():
        for family, hf in hf_dirs.items():
            spec = ModelSpec.from_hf_dir(hf)
            config = transformer_config(spec, ParallelConfig(), use_te=False, perform_initialization=False)
            with torch.device("meta"):
                model = build_model(spec, config, use_te=False)
            sharded = model.sharded_state_dict()
            apply_factories(sharded)
            out[family] = sorted(
                {
                    (v.key, tuple(v.global_offset[: v.prepend_axis_num]))
                    for v in nested_values(sharded)
                    if isinstance(v, ShardedTensor)
                }  # fmt: skip
            )
    return out


def _bf16_router_loads_exactly(hf: str, ckpt: str) -> bool:
    """A bf16 model loads the fp32-stored router weight of a bf16 checkpoint as HF's fp32 gate rounded to bf16."""
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.models.builder import ModelSpec, build_model, transformer_config
    from megatron_sao.models.checkpoint import load_model_weights
    from megatron_sao.models.weights import HFCheckpoint

    spec = ModelSpec.from_hf_dir(hf, dtype="bf16")
    init_distributed(ParallelConfig())
    model = build_model(spec, transformer_config(spec, ParallelConfig()))
    load_model_weights(model, ckpt, spec=spec)
    router = model.decoder.layers[1].mlp.router.weight
    gate = HFCheckpoint(hf).get("model.layers.1.mlp.gate.weight")
    destroy_distributed(keep_process_group=True)
    return router.dtype == torch.bfloat16 and torch.equal(router, gate.to(torch.bfloat16))


def conversion_worker(
    models: dict[str, str], fp32_models: list[str], bad_hf: dict[str, str], other_config: str, root: str,
    tokens: torch.Tensor,
) -> dict[str, Any]:  # fmt: skip
    """One process: convert every model HF -> megatron -> HF, TP=1 logits of the fp32 ones, the bad-input
    errors, the local spec's raw keys, and the bf16 router check."""
    from megatron.core import dist_checkpointing

    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_sao.convert.parity import layout_logits
    from megatron_sao.distributed import destroy_distributed

    base = Path(root)
    out: dict[str, Any] = {"ckpt": {}, "back": {}, "stored": {}, "tp1": {}}
    for name, hf in models.items():
        ckpt = convert_hf_to_megatron(hf, base / f"ckpt_{name}", progress=False)
        back = convert_megatron_to_hf(ckpt, base / f"back_{name}", hf, max_shard_size="150KB", progress=False)
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        out["ckpt"][name], out["back"][name] = str(ckpt), str(back)
        out["stored"][name] = {k: (tuple(v.global_shape), str(v.dtype)) for k, v in meta.items()}
    for name in fp32_models:
        out["tp1"][name] = layout_logits(models[name], out["ckpt"][name], {"tp1": ParallelConfig()}, tokens)["tp1"]
        out["tp1"][name] = out["tp1"][name].numpy()
    out["errors"] = {
        case: _error(lambda h=hf, c=case: convert_hf_to_megatron(h, base / f"bad_{c}", progress=False))
        for case, hf in bad_hf.items()
    }
    out["errors"].update(_bad_checkpoints(out["ckpt"]["qwen3_moe"], models["qwen3_moe"], other_config, base))
    out["local_keys"] = _local_spec_keys({f: models[f] for f in ("qwen3_moe", "glm4_moe", "glm_moe_dsa")})
    out["bf16_router_exact"] = _bf16_router_loads_exactly(models["glm4_moe_bf16"], out["ckpt"]["glm4_moe_bf16"])
    forced = base / "forced"
    forced.mkdir()
    (forced / "stale.txt").write_text("old")
    convert_hf_to_megatron(models["qwen3_moe"], forced, force=True, progress=False)
    out["force_replaced"] = sorted(p.name for p in forced.iterdir())
    destroy_distributed()
    for d in base.glob("o_*"):
        shutil.rmtree(d, ignore_errors=True)
    return out


def multi_rank_worker(jobs: dict[str, tuple[str, str, list[str]]], tokens: torch.Tensor) -> dict[str, Any]:
    """On each of 2 ranks: for every model, the logits at each asked layout (None off the last stage)."""
    from megatron_sao.convert.parity import layout_logits
    from megatron_sao.distributed import destroy_distributed

    out: dict[str, Any] = {}
    for name, (hf, ckpt, layouts) in jobs.items():
        logits = layout_logits(hf, ckpt, {k: MULTI_RANK_LAYOUTS[k] for k in layouts}, tokens)
        out[name] = {k: None if v is None else v.numpy() for k, v in logits.items()}
    destroy_distributed()
    return out
