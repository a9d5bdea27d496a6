"""megatron-core's real code paths on CPU through the platform layer: MoE with TP+SP, EP, PP, DDP with the
distributed optimizer, and dist_checkpointing resume. Two gloo ranks, fp32, tiny model (megatron_sao.smoke)."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.config import ParallelConfig
from megatron_sao.distributed import spawn_ranks

LAYOUTS = {
    "tp2_sp": ParallelConfig(tensor=2),
    "ep2": ParallelConfig(expert=2),
    "tp2_sp_ep2": ParallelConfig(tensor=2, expert=2, expert_tensor=1),
    "pp2": ParallelConfig(pipeline=2),
}


def _build(parallel: ParallelConfig, dtype: str = "fp32"):
    from megatron_sao.smoke import build_tiny_gpt, tiny_transformer_config

    config = tiny_transformer_config(parallel, dtype)
    return config, build_tiny_gpt(config)


def _save_model(model, path: str) -> None:
    from pathlib import Path

    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load_model(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state)


def _losses_across_layouts(ckpt_dir: str) -> dict[str, list[float]]:
    """Reference at TP1 (DP2), then each layout loads the same weights from a dist checkpoint."""
    import torch.distributed as dist

    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.smoke import lm_forward_backward, synthetic_batch

    batch = synthetic_batch(batch_size=4)
    init_distributed(ParallelConfig(), seed=7)
    _, model = _build(ParallelConfig())
    _save_model(model, ckpt_dir)
    out = {"tp1": lm_forward_backward(model, batch, num_microbatches=2)}
    for name, parallel in LAYOUTS.items():
        destroy_distributed(keep_process_group=True)
        init_distributed(parallel, seed=99)  # another seed: the weights must come from the checkpoint
        _, model = _build(parallel)
        _load_model(model, ckpt_dir)
        out[name] = lm_forward_backward(model, batch, num_microbatches=2)
        dist.barrier()
    destroy_distributed()
    return out


@pytest.mark.multiproc
def test_tp_sp_ep_pp_layouts_give_the_tp1_loss(tmp_path):
    per_rank = spawn_ranks(_losses_across_layouts, 2, str(tmp_path / "ckpt"), timeout_s=300)
    ref = per_rank[0]["tp1"]
    assert len(ref) == 2
    for rank, losses in enumerate(per_rank):
        for name in ["tp1", "tp2_sp", "ep2", "tp2_sp_ep2"]:
            assert losses[name] == pytest.approx(ref, abs=1e-5), (rank, name)
    # PP=2: only the last stage (rank 1) computes losses; it ran megatron's 1F1B schedule.
    assert per_rank[0]["pp2"] == []
    assert per_rank[1]["pp2"] == pytest.approx(ref, abs=1e-5)


def _train_and_resume(ckpt_dir: str, parallel: ParallelConfig, dtype: str) -> dict:
    """2 steps, save (model + distributed optimizer), 2 more steps; a fresh model+optimizer loads and redoes
    those 2 steps. Returns both continuations, the Adam step counts and the max parameter difference."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.smoke import synthetic_batch, train_step, wrap_ddp_and_optimizer

    init_distributed(parallel, seed=11)
    batches = [synthetic_batch(batch_size=4, seed=s) for s in (0, 0, 1, 2)]
    meta = {"distrib_optim_sharding_type": "dp_reshardable"}

    def fresh():
        config, model = _build(parallel, dtype)
        return wrap_ddp_and_optimizer(model, config, use_distributed_optimizer=True)

    ddp, opt = fresh()
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    first = [train_step(ddp, opt, b)[0] for b in batches[:2]]
    model_sd = ddp.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=meta)}, ckpt_dir)
    cont = [train_step(ddp, opt, b) for b in batches[2:]]
    params = [p.detach().clone() for p in ddp.module.parameters()]

    ddp2, opt2 = fresh()
    model_sd2 = ddp2.module.sharded_state_dict()
    state = {"model": model_sd2, "optimizer": opt2.sharded_state_dict(model_sd2, is_loading=True, metadata=meta)}
    loaded = dist_checkpointing.load(state, ckpt_dir)
    ddp2.module.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    steps_after_load = sorted({float(s["step"]) for o in opt2.chained_optimizers for s in o.optimizer.state.values()})
    resumed = [train_step(ddp2, opt2, b) for b in batches[2:]]
    steps_end = sorted({float(s["step"]) for o in opt2.chained_optimizers for s in o.optimizer.state.values()})
    max_diff = max(float((a - b.detach()).abs().max()) for a, b in zip(params, ddp2.module.parameters()))
    destroy_distributed()
    return dict(
        first=first,
        cont=cont,
        resumed=resumed,
        steps_after_load=steps_after_load,
        steps_end=steps_end,
        max_param_diff=max_diff,
    )


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "layout",
    [ParallelConfig(), ParallelConfig(expert=2), ParallelConfig(tensor=2), ParallelConfig(pipeline=2)],
    ids=["dp2", "ep2", "tp2_sp", "pp2"],
)
def test_distributed_optimizer_checkpoint_resumes_bit_exactly(tmp_path, layout):
    for out in spawn_ranks(_train_and_resume, 2, str(tmp_path / "ckpt"), layout, "fp32", timeout_s=300):
        if out["first"][0]:  # ranks holding the loss (all but the first PP stage)
            assert out["first"][1][0] < out["first"][0][0]  # two steps on the same batch: it learns
        assert out["resumed"] == out["cont"]  # same losses and grad norms, bitwise
        assert out["max_param_diff"] == 0.0
        # Adam's per-parameter step is the saved iteration (2), not the dummy step (1) torch-Adam loads with.
        assert out["steps_after_load"] == [2.0]
        assert out["steps_end"] == [4.0]


@pytest.mark.multiproc
@pytest.mark.slow
def test_bf16_distributed_optimizer_resume_is_exact(tmp_path):
    for out in spawn_ranks(_train_and_resume, 2, str(tmp_path / "ckpt"), ParallelConfig(), "bf16", timeout_s=300):
        assert out["resumed"] == out["cont"]
        assert out["steps_after_load"] == [2.0]


def test_platform_layer_stays_off_when_cuda_is_available(monkeypatch):
    import megatron_sao.platform_layer as platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(platform, "_applied", [])
    monkeypatch.setattr(platform, "_applied_no_te", [])
    monkeypatch.setattr(platform, "transformer_engine_installed", lambda: True)
    info = platform.activate(local_rank=3)
    assert info.dist_backend == "nccl"
    assert info.device == torch.device("cuda", 3)
    assert not info.cpu_layer_active and info.applied == ()
    assert platform._applied == []
    # a Slurm task that sees only its own GPU (CUDA_VISIBLE_DEVICES) while SLURM_LOCALID is 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert platform.activate(local_rank=3).device == torch.device("cuda", 0)


def test_a_gpu_without_transformer_engine_gets_only_the_no_te_patches(monkeypatch):
    """On an H200 without TE, megatron-core 0.16.1's router raised NameError: te_general_gemm; the patches whose
    failure is TE's absence apply there, the CPU ones do not."""
    import megatron_sao.platform_layer as platform
    from megatron_sao.platform_layer.registry import NO_TE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(platform, "_applied", [])
    monkeypatch.setattr(platform, "_applied_no_te", [])
    monkeypatch.setattr(platform, "transformer_engine_installed", lambda: False)
    applied: list[str] = []
    patches = platform.describe_patches()
    monkeypatch.setattr(platform, "PATCHES", [type(p)(p.name, p.works_around, p.why, lambda n=p.name: applied.append(n),
                                                      p.checked_on, p.tags) for p in patches])  # fmt: skip
    info = platform.activate()
    no_te = [p.name for p in patches if NO_TE in p.tags]
    assert set(no_te) == {"moe-te-general-gemm-name", "mla-have-te-flag", "torch-norm-sequence-parallel"}
    assert applied == no_te and info.applied == tuple(no_te) and not info.cpu_layer_active
    assert info.dist_backend == "nccl" and platform._applied == []


def test_every_patch_names_its_target_reason_and_versions():
    from megatron_sao.platform_layer import describe_patches

    patches = describe_patches()
    assert len({p.name for p in patches}) == len(patches) >= 10
    for p in patches:
        assert "megatron" in p.works_around or "torch" in p.works_around
        assert len(p.why) > 40 and p.checked_on


def test_untested_megatron_version_warns(monkeypatch):
    import megatron_sao.platform_layer as platform

    monkeypatch.setattr(platform, "_applied", [])
    monkeypatch.setattr(platform, "megatron_version", lambda: "9.9.9")
    monkeypatch.setattr(platform, "PATCHES", [])
    with pytest.warns(platform.UntestedMegatronWarning, match="9.9.9"):
        platform.activate()
