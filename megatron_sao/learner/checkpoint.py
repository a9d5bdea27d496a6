"""Learner checkpoints with megatron's dist_checkpointing (torch_dist): both models, both (distributed)
optimizers, LR schedulers, step counters, RNG states and an opaque `extra` dict (bus de-dup state, prompt
cursor, ...). Model weights and optimizer state reshard on load, so a run saved at one TP/EP/PP/DP layout
resumes at another; at the same layout the resume is bit-exact.

Layout on disk: `<save_dir>/iter_<version:07d>/` (one dist checkpoint with `checksums.json`, renamed into place only
once complete) and `<save_dir>/latest` naming the newest one; loading verifies the files and falls back from a
damaged `latest` to the newest intact checkpoint (learner/integrity.py). Model keys are prefixed `policy.` / `value.`.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sao.distributed.collectives import all_gather_object, share, world_position
from megatron_sao.files import CHECKPOINTS_DIR
from megatron_sao.learner.integrity import describe_save_error, partial_dir, verify_checksums, write_checksums
from megatron_sao.models.checkpoint import (
    HF_SOURCE_KEY,
    POLICY_PREFIX,
    CheckpointMismatchError,
    check_hf_source,
    hf_source_record,
    is_extra_state,
    model_sharded_state_dict,
    read_hf_source,
)

if TYPE_CHECKING:
    from megatron_sao.config import SAOConfig
    from megatron_sao.learner.learner import Learner

logger = logging.getLogger(__name__)

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""Optimizer state in model space: loads under any TP/EP/PP/DP (dp_reshardable would only allow DP changes)."""
LATEST = "latest"


def checkpoint_dir(cfg: SAOConfig) -> Path:
    """learner.save_dir, else <launch.run_dir>/checkpoints."""
    return Path(cfg.learner.save_dir or Path(cfg.launch.run_dir) / CHECKPOINTS_DIR)


def own_checkpoint_dir(cfg: SAOConfig) -> Path:
    """Where the learner job's `latest` lives: checkpoint_dir, or its `policy` subdirectory beside a value job
    (config.roles.Jobs: the value job's is `value`)."""
    return checkpoint_dir(cfg) / cfg.jobs.learner.checkpoint_subdir


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this learner; the message says why and what to do."""


def _layout(learner: Learner) -> dict[str, int]:
    """The layout a checkpoint records (world and model-parallel sizes): RNG states only load into the same one."""
    return {"world": learner.layout.world_size, **learner.layout.model_parallel_sizes()}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state(learner: Learner, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict[str, Any] = {}
    for role in (learner.policy, learner.value):
        if role is None:
            continue
        model_sd = model_sharded_state_dict(role.model, prefix=f"{role.role}.")  # canonical, spec-independent keys
        state[role.role] = model_sd
        # A role that trains some layers and not others (learner.<role>.trainable naming layers) has optimizer state
        # for part of each layer-stacked tensor, which the checkpoint refuses as an invalid access pattern: its
        # optimizer state is keyed per layer instead. The rule depends on the patterns only, so a save and any later
        # load (at any pipeline split) agree on it.
        optim_sd = model_sd if not role.layer_selective else model_sharded_state_dict(
            role.model, prefix=f"{role.role}.", per_layer=True)  # fmt: skip
        state[f"{role.role}_optimizer"] = role.optimizer.sharded_state_dict(
            optim_sd, is_loading=is_loading, metadata=OPTIMIZER_FORMAT
        )
    rank, world = learner.layout.rank, learner.layout.world_size
    state["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def _common_state(learner: Learner, extra: dict[str, Any] | None) -> dict[str, Any]:
    common: dict[str, Any] = {
        "version": learner.version,
        "trajectories_trained": learner.trajectories_trained,
        "value_head_fitted": learner.value_head_fitted,
        "layout": _layout(learner),
        "model": {"family": learner.spec.family.name, "hf_config": learner.spec.hf, "dtype": learner.spec.dtype},
        HF_SOURCE_KEY: learner.hf_source or hf_source_record(learner.spec, {}),
        "algo": learner.cfg.algo.name,
        "extra": extra or {},
    }
    for role in (learner.policy, learner.value):
        if role is not None:
            common[f"{role.role}_scheduler"] = role.scheduler.state_dict()
            common[f"{role.role}_optimizer_steps"] = role.optimizer_steps
    if learner.running_mean is not None:
        common["running_mean"] = learner.running_mean.state_dict()
    if learner.state_values is not None:
        common["state_values"] = learner.state_values.state_dict()
    return common


def role_dir(learner: Learner, save_dir: str | Path) -> Path:
    """Where this learner's checkpoints live: `save_dir`, or its job's subdirectory (config.roles.LearnerJob:
    `policy` / `value` for the learner job and the value job of a critic on its own ranks, which save the same
    versions and must not share directories)."""
    return Path(save_dir) / learner.job.checkpoint_subdir


def _raise_on_every_rank(error: str | None) -> None:
    """Collective: rank 0's verdict reaches every rank, so a refusal never leaves the others in a barrier."""
    verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])


def save_checkpoint(
    learner: Learner, save_dir: str | Path, extra: dict[str, Any] | None = None, tag: str | None = None
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory (see role_dir for separate jobs): `tag`, or
    iter_<version> (value pre-training saves as pretrain_<step>: the version stays 0 through it)."""
    from megatron.core import dist_checkpointing

    save_dir = role_dir(learner, save_dir)
    path = save_dir / (tag or f"iter_{learner.version:07d}")
    partial = partial_dir(path)
    error = None
    if learner.layout.is_rank0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            if path.exists() and any(path.iterdir()) and _abandoned(learner, path):
                target = _aside_name(path, "abandoned")
                path.rename(target)  # a version of a line the run went back from: kept, never deleted
                logger.warning("%s is from versions this run went back from (it resumed from %s): moved aside to %s",
                               path.name, learner.loaded_from, target.name)  # fmt: skip
            if path.exists() and any(path.iterdir()):
                error = f"{path} already holds a checkpoint; remove it or save at another version"
            else:
                if path.exists():
                    path.rmdir()  # an empty directory (older releases made it before saving into it)
                if partial.exists():
                    shutil.rmtree(partial)  # a save of this name that was cut (crash, full disk): never a blocker
                partial.mkdir()
        except OSError as e:
            error = describe_save_error(e, path)
    _raise_on_every_rank(error)
    state = _sharded_state(learner, is_loading=False)
    common = _common_state(learner, extra)
    state[HF_SOURCE_KEY] = common.pop(HF_SOURCE_KEY)  # top level: where tools/convert_megatron_to_hf.py reads it
    state["common"] = common
    failure = None
    try:
        dist_checkpointing.save(state, str(partial))
    except Exception as e:  # OSError, or torch's writer naming no errno (`unexpected pos ...`) on a full disk
        logger.debug("saving %s failed", path, exc_info=True)
        failure = describe_save_error(e, path)
    failures = [f for f in all_gather_object(failure) if f]
    if not failures:
        dist.barrier()
        try:
            write_checksums(partial)
        except OSError as e:
            failures = [describe_save_error(e, path)]
    error = None
    if learner.layout.is_rank0:
        try:
            if failures:
                error = str(failures[0])
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.rename(path)  # complete: only now does iter_N exist
                tmp = save_dir / f".{LATEST}.tmp"
                tmp.write_text(path.name + "\n")
                tmp.replace(save_dir / LATEST)  # atomic: `latest` never names a partial checkpoint
        except OSError as e:
            error = describe_save_error(e, path)
    _raise_on_every_rank(error)
    return path


def prune_checkpoints(save_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete `iter_*` checkpoints of `save_dir` (never the one `latest` names);
    the deleted paths. pretrain_*, partial and set-aside directories are left alone."""
    root = Path(save_dir)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    done = sorted((p for p in root.glob("iter_*") if p.is_dir() and re.fullmatch(r"iter_\d+", p.name)),
                  key=lambda p: int(p.name.removeprefix("iter_")))  # fmt: skip
    gone = [p for p in done[: max(len(done) - keep, 0)] if p.name != latest]
    for p in gone:
        shutil.rmtree(p)
    if gone:
        logger.info("learner.keep_checkpoints=%d: deleted %s", keep, ", ".join(p.name for p in gone))
    return gone


def _abandoned(learner: Learner, path: Path) -> bool:
    """Whether the checkpoint at `path` is ahead of the one this learner resumed from in the same directory: the run
    went back to an older checkpoint (the newer ones damaged, or learner.load chose it), so `path` holds versions
    of a line it abandoned."""
    loaded = learner.loaded_from
    if loaded is None or loaded.parent.resolve() != path.parent.resolve():
        return False
    order = {p.name: i for i, p in enumerate(reversed(_checkpoints_in(path.parent)))}  # oldest first
    return path.name in order and loaded.name in order and order[path.name] > order[loaded.name]


def _checkpoints_in(save_dir: Path) -> list[Path]:
    """Complete checkpoints under save_dir, newest first: policy versions (iter_N) before pre-training steps."""
    found = []
    for p in save_dir.iterdir():
        m = re.fullmatch(r"(iter|pretrain)_(\d+)", p.name)
        if m and p.is_dir() and (p / "metadata.json").is_file():
            found.append(((m.group(1) == "iter", int(m.group(2))), p))
    return [p for _, p in sorted(found, reverse=True)]


def intact_checkpoint(path: str | Path) -> Path:
    """Collective: the checkpoint to load from `path` -- a checkpoint directory, or a save_dir whose `latest` names
    one -- after verifying its files (learner/integrity.py). A damaged (or missing) `latest` falls back to the newest
    intact checkpoint of the save_dir, saying so: the damaged ones are moved aside (`<name>.damaged`, kept for a
    look, never deleted) and `latest` names the one loaded, so the run saves those versions again. None intact, or a
    damaged directory named directly: CheckpointError with the bad file and the fix."""
    path = Path(path)
    if not (path / LATEST).is_file():
        path = resolve_checkpoint(path)
        problem = verify_checksums(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}; load another one (learner.load)")
        return path
    named = path / (path / LATEST).read_text().strip()
    problems: list[str] = []
    damaged: list[Path] = []
    for candidate in [named, *(c for c in _checkpoints_in(path) if c != named)]:
        problem = verify_checksums(candidate) if (candidate / "metadata.json").is_file() else (
            f"{candidate} is missing or incomplete (no metadata.json)")  # fmt: skip
        if problem is None:
            if candidate != named:
                logger.warning("%s names %s, which is damaged (%s); loading %s, the newest intact checkpoint",
                               path / LATEST, named.name, problems[0], candidate.name)  # fmt: skip
                _set_aside(path, damaged, candidate)
            return candidate
        problems.append(problem)
        if candidate.is_dir():
            damaged.append(candidate)
    raise CheckpointError(f"no intact checkpoint in {path}: {'; '.join(problems)}. Move {path} away to start from "
                          "model.hf_path, or set learner.load to a checkpoint that is intact")  # fmt: skip


def _aside_name(path: Path, why: str) -> Path:
    """`<path>.<why>`, or `<path>.<why>.<n>` when that is taken: nothing set aside is ever overwritten."""
    target, n = path.with_name(f"{path.name}.{why}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}.{n}")
    return target


def _set_aside(save_dir: Path, damaged: list[Path], loaded: Path) -> None:
    """Collective (rank 0 works): damaged checkpoints renamed `<name>.damaged`, `latest` set to the one loaded. A
    read-only save_dir (another run's) is left as it is, with a warning."""
    error = None
    if world_position()[0] == 0:
        try:
            for bad in damaged:
                target = _aside_name(bad, "damaged")
                bad.rename(target)
                logger.warning("moved the damaged checkpoint %s aside to %s (kept, never deleted)", bad, target.name)
            tmp = save_dir / f".{LATEST}.tmp"
            tmp.write_text(loaded.name + "\n")
            tmp.replace(save_dir / LATEST)
        except OSError as e:
            error = f"could not move the damaged checkpoints in {save_dir} aside ({e}); saving there will refuse them"
    error = share(error)
    if error:
        logger.warning("%s", error)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a save_dir whose `latest` names one."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is not a megatron dist checkpoint (no metadata.json) and has no '{LATEST}'")
    return path


def _load_weights(model: Any, loaded: dict[str, Any], prefix: str, path: Path, allow_missing: str = "") -> None:
    weights = {k.removeprefix(prefix): v for k, v in loaded.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not is_extra_state(k) and not (allow_missing and k.startswith(allow_missing))]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]} ({prefix}*)")


def load_pretrained(learner: Learner, path: str | Path) -> None:
    """Initialize both models from a weights-only checkpoint (tools/convert_hf_to_megatron.py output, or the
    policy of a learner checkpoint): the value backbone starts from the policy's weights, its head stays new."""
    from megatron.core import dist_checkpointing

    path = intact_checkpoint(path)
    record = read_hf_source(path)
    if record is not None:
        try:
            check_hf_source(record, learner.spec, "this learner's model")
        except CheckpointMismatchError as e:
            raise CheckpointError(str(e)) from None
        learner.hf_source = record
    for role in (learner.policy, learner.value):
        if role is None:
            continue
        sharded = model_sharded_state_dict(role.model, POLICY_PREFIX)
        head = "output_layer." if role.role == "value" else ""
        if head:
            sharded = {k: v for k, v in sharded.items() if not k.startswith(POLICY_PREFIX + head)}
        loaded = dist_checkpointing.load(sharded, str(path))
        _load_weights(role.model, loaded, POLICY_PREFIX, path, allow_missing=head)
        role.reload_main_params()
    learner.value_head_fitted = False  # the head stays new (zero): its bias is set from the first batch


ARCHITECTURE_KEYS = (
    "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "tie_word_embeddings",
)  # fmt: skip
"""HF config keys that shape the weights: a checkpoint resumes only into the same values (a key absent on both
sides is equal)."""


def _check_compatible(learner: Learner, common: dict[str, Any], path: Path) -> None:
    saved = common.get("model", {})
    if saved.get("family") != learner.spec.family.name:
        raise CheckpointError(
            f"{path} holds a {saved.get('family')} model but this learner builds {learner.spec.family.name}; "
            f"point learner.load at a checkpoint of the same model"
        )
    diff = {k: (saved.get("hf_config", {}).get(k), learner.spec.hf.get(k)) for k in ARCHITECTURE_KEYS}
    diff = {k: v for k, v in diff.items() if v[0] != v[1]}
    if diff:
        shown = ", ".join(f"{k} {a} (saved) != {b} (this model)" for k, (a, b) in diff.items())
        raise CheckpointError(f"{path} was saved for another architecture: {shown}; point learner.load (or "
                              "launch.run_dir) at a checkpoint of this model, or model.hf_path at its "
                              "model")  # fmt: skip
    algo = common.get("algo")
    if algo is not None and algo != learner.cfg.algo.name:
        logger.warning("%s was trained with algo.name=%s; resuming it as %s (the optimizer state and schedules go "
                       "on; the new algorithm starts from that policy)", path, algo, learner.cfg.algo.name)  # fmt: skip


def _chained_optimizer_state(loaded: dict[Any, Any], optimizer: Any) -> Any:
    """Fit the loaded optimizer state to this layout's chain of optimizers.

    megatron splits expert parameters into their own DistributedOptimizer only when expert parallelism needs it,
    so a checkpoint saved with one optimizer (flat dict) may load into two ({0: ..., 1: ...}) or the reverse.
    The tensor state is keyed by parameter name and already sits in this layout's structure; the per-optimizer
    common part (param groups: LR, step, betas) is merged from whatever the checkpoint had, and each optimizer
    picks its groups by megatron's group identifiers (is_expert_parallel, wd_mult, ...).
    """
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    saved = (
        [loaded]
        if "optimizer" in loaded
        else [
            v
            for k, v in sorted(loaded.items(), key=lambda kv: str(kv[0]))
            if isinstance(k, int) and isinstance(v, dict) and "optimizer" in v
        ]
    )
    if not saved:
        raise CheckpointError("the checkpoint's optimizer state has no param groups; it was not saved by this learner")
    groups = [g for entry in saved for g in entry["optimizer"]["param_groups"]]
    # At EP=1 expert parameters are not marked expert-parallel; their groups serve either marking.
    known = {
        (g.get("wd_mult"), g.get("lr_mult"), g.get("is_expert_parallel"), g.get("is_decoupled_lr")) for g in groups
    }
    for g in list(groups):
        flipped = {**g, "is_expert_parallel": not g.get("is_expert_parallel", False)}
        key = (g.get("wd_mult"), g.get("lr_mult"), flipped["is_expert_parallel"], g.get("is_decoupled_lr"))
        if key not in known:
            groups.append(flipped)
            known.add(key)
    local = [loaded] if len(chain) == 1 else [loaded[i] for i in range(len(chain))]
    merged = []
    for entry in local:
        entry = dict(entry)
        entry["optimizer"] = {**saved[0]["optimizer"], "param_groups": groups}
        entry.setdefault("param_state_sharding_type", saved[0].get("param_state_sharding_type"))
        merged.append(entry)
    return merged[0] if len(chain) == 1 else dict(enumerate(merged))


def load_checkpoint(learner: Learner, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
    """Collective. Restores everything `save_checkpoint` wrote (optimizers unless load_optimizer=False) and
    returns the `extra` dict. RNG states are restored only at the layout they were saved at."""
    from megatron.core import dist_checkpointing

    if (role_dir(learner, path) / LATEST).is_file():
        path = role_dir(learner, path)  # the job's own directory under a shared save_dir
    path = intact_checkpoint(path)
    learner.loaded_from = path
    try:
        saved = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # pickle / EOF / decode errors name no file: this does
        raise CheckpointError(f"{path / 'common.pt'} cannot be read ({type(e).__name__}: {e})") from None
    common = saved["common"]
    _check_compatible(learner, common, path)
    state = _sharded_state(learner, is_loading=True)
    if not load_optimizer:
        state = {k: v for k, v in state.items() if not k.endswith("_optimizer")}
    same_layout = common["layout"] == _layout(learner)
    if not same_layout:
        state.pop("rng")
        logger.warning(
            "checkpoint layout %s differs from %s: RNG states not restored", common["layout"], _layout(learner)
        )
    loaded = dist_checkpointing.load(state, str(path))
    for role in (learner.policy, learner.value):
        if role is None:
            continue
        _load_weights(role.model, loaded[role.role], f"{role.role}.", path)
        if not load_optimizer:
            role.reload_main_params()
        else:
            role.optimizer.load_state_dict(_chained_optimizer_state(loaded[f"{role.role}_optimizer"], role.optimizer))
            role.scheduler.load_state_dict(common[f"{role.role}_scheduler"])
            role.optimizer_steps = int(common[f"{role.role}_optimizer_steps"])
    learner.hf_source = saved.get(HF_SOURCE_KEY) or learner.hf_source
    learner.version = int(common["version"])
    learner.trajectories_trained = int(common["trajectories_trained"])
    learner.value_head_fitted = bool(common.get("value_head_fitted", True))  # older checkpoints: a trained head
    if learner.running_mean is not None and "running_mean" in common:
        learner.running_mean.load_state_dict(common["running_mean"])
    if learner.state_values is not None and "state_values" in common:
        learner.state_values.load_state_dict(common["state_values"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    return dict(common.get("extra", {}))


def describe(path: str | Path) -> str:
    """Human summary of a checkpoint (for logs and the CLI)."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    return json.dumps({k: common[k] for k in ("version", "trajectories_trained", "layout", "algo")}, indent=2)
