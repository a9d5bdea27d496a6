"""`python -m megatron_sao <command>`: the project's command line (each command lives with what it runs).

config show FILE [--section.key VALUE ...]   print the resolved config tree
config check FILE [...]                      validate only (exit 2 with the errors)
platform                                     list the CPU platform patches and whether they apply here
smoke                                        build and train a tiny megatron-core MoE model for a few steps
engine --model DIR --port N [...]            embedded CPU engine speaking SGLang's HTTP API (engines/embedded/)
agent --engine URL --port N [...]            push agent beside an engine: receives a push without pausing it, then
                                             hands each engine rank its slice (engines/agent/)
run CONFIG [--section.key VALUE ...]         the whole run: on this machine (launch.mode=local), or every role as
                                             an srun step inside a Slurm allocation (launch.mode=slurm; --dry-run
                                             prints the node map and every command)
plan CONFIG --nodes N [--gpus-per-node 8 --gpu-mem-gb 80 --ib-gbps 400 ...]
                                             will it fit: topology checks, per-GPU memory of the learner's stages and
                                             the engines, the weight push's bytes and time (exit 1: what to change)
submit CONFIG [...] [--dry-run] [--wait]     write <run_dir>/slurm.sbatch for a launch.mode=slurm run and sbatch it
plot RUN_DIR [RUN_DIR ...] [--out DIR]       PNGs of runs' metrics (reward, masked fraction, staleness, losses, ...)
ledger RUN_DIR                               check that every trajectory was trained once, dropped, or is pending
eval CONFIG [--checkpoint PATH|RUN_DIR]      held-out evaluation of a checkpoint on engines started for it: pass@1,
                                             pass@k, avg@k, reward (a table; <run_dir>/eval/results.jsonl)
learn CONFIG --engines URLS [...]            the learner loop (every rank; under torchrun / srun on clusters)
critic CONFIG --bridge tcp://HOST:PORT [...] the value job of a critic on its own ranks (learner.
                                             value_on_separate_ranks; `run` starts it)
rollout CONFIG --engines URLS [...]          one rollout worker pushing trajectories onto the bus
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {}


def command(name: str) -> Callable[[Callable[[argparse.Namespace, list[str]], int]], Callable[..., int]]:
    def deco(fn: Callable[[argparse.Namespace, list[str]], int]) -> Callable[..., int]:
        COMMANDS[name] = fn
        return fn

    return deco


@command("config")
def _config(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.config import config_to_yaml

    p = argparse.ArgumentParser(prog="python -m megatron_sao config")
    p.add_argument("action", choices=["show", "check"])
    p.add_argument("file", nargs="?", help="YAML or TOML config; omit for the defaults")
    p.add_argument("--model-elsewhere", action="store_true", help="check: the run starts on another machine (a "
                   "script's --dry-run on a laptop): a model.hf_path that is not here is a note")  # fmt: skip
    args, overrides = _parse(p, rest)
    # a local run starts here: its model must be here (model_here None); a cluster's may be elsewhere
    here = False if args.model_elsewhere else None
    cfg = _read_config(args.file, overrides, preflight=args.action == "check", model_here=here)
    if cfg is None:
        return 2
    if args.action == "show":
        print(config_to_yaml(cfg), end="")
    else:
        _model_note(cfg)
        print(f"{args.file or 'defaults'}: ok")
    return 0


@command("platform")
def _platform(ns: argparse.Namespace, rest: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m megatron_sao platform", description="the platform layer's patches: "
                            "which megatron-core function each works around, why, and whether they apply here"
                            ).parse_args(rest)  # fmt: skip
    import torch

    from megatron_sao.platform_layer import (
        CHECKED_MEGATRON_VERSIONS,
        describe_patches,
        megatron_version,
        transformer_engine_installed,
    )
    from megatron_sao.platform_layer.registry import NO_TE

    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {'available' if cuda else 'absent'}, megatron-core {megatron_version()}")
    if not cuda:
        state = "active"
    elif transformer_engine_installed():
        state = "inactive (GPU with Transformer Engine)"
    else:
        state = "only the no-te patches (GPU without Transformer Engine)"
    print(f"CPU platform layer: {state}; checked on {CHECKED_MEGATRON_VERSIONS}")
    for patch in describe_patches():
        tag = " [no-te: also on a GPU without Transformer Engine]" if NO_TE in patch.tags else ""
        print(f"\n- {patch.name} (checked on {', '.join(patch.checked_on)}){tag}")
        print(f"  works around: {patch.works_around}")
        print(f"  why: {patch.why}")
    return 0


@command("smoke")
def _smoke(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.smoke import main as smoke_main

    return smoke_main(rest)


@command("engine")
def _engine(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.engines.embedded.cli import main as engine_main

    return engine_main(rest)


@command("agent")
def _agent(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.engines.agent.cli import main as agent_main

    return agent_main(rest)


def _read_config(path: str | None, overrides: list[str], preflight: bool = True,
                 model_here: bool | None = False) -> Any:  # fmt: skip
    """The resolved config, or None after printing the error (which names the field and the fix); with `preflight`
    also what it names that must exist (run/preflight.py: the environment, paths, the model's family; the model
    directory itself when `model_here`, else a note)."""
    from megatron_sao.config import ConfigError, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if preflight:
        from megatron_sao.run.preflight import problems

        found = problems(cfg, cfg.launch.mode == "local" if model_here is None else model_here)
        for line in found:
            print(f"error: {line}", file=sys.stderr)
        if found:
            return None
    return cfg


def _model_note(cfg: Any) -> None:
    """`config check`: say when model.hf_path is not on this machine (fine where the run starts elsewhere)."""
    from megatron_sao.run.preflight import missing_model

    if (note := missing_model(cfg)) is not None:
        print(f"note: {note.replace('; point it at', ' here (fine where the run starts elsewhere); point it at')}",
              file=sys.stderr)  # fmt: skip


def _load(
    prog: str, rest: list[str], engines: bool = False, launch: bool = False
) -> tuple[Any, argparse.Namespace, list[str]] | None:
    """(config, parsed args, dotted overrides) with logging set up from the config; None after printing an error."""
    p = argparse.ArgumentParser(prog=f"python -m megatron_sao {prog}")
    p.add_argument("config", help="the run's YAML/TOML config")
    if engines:
        p.add_argument("--engines", default="", help="comma-separated engine URLs the learner pushes weights to")
    if prog == "learn":
        p.add_argument("--ready-file", default=None, help="created (rank 0) once the learner listens for trajectories "
                       "and the engines hold its weights: start rollout workers after it appears")  # fmt: skip
        p.add_argument("--critic-bridge", default=None, help="learner.value_on_separate_ranks: tcp://HOST:PORT this "
                       "job (rank 0's host) serves the bridge to the value job on")  # fmt: skip
    if prog == "critic":
        p.add_argument("--bridge", required=True, help="tcp://HOST:PORT of the policy job's bridge (its rank 0)")
    if launch:
        p.add_argument("--dry-run", action="store_true", help="print the plan and every command; start nothing")
    if prog == "submit":
        p.add_argument("--wait", action="store_true", help="block until the job ends; exit with its status")
    if prog == "eval":
        p.add_argument("--checkpoint", default=None, help="a run dir, a save dir or one checkpoint (default: the "
                       "config's launch.run_dir; 'none': the initial weights, model.hf_path)")  # fmt: skip
    args, overrides = _parse(p, rest)
    # the model must be here for the roles that load it now, and for a local run (its engines and learner start here)
    here = prog in ("learn", "critic", "eval") or (prog == "run" and not args.dry_run and _local(args, overrides))
    cfg = _read_config(args.config, overrides, model_here=here)
    if cfg is None:
        return None
    import logging

    logging.basicConfig(level=cfg.launch.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.launch.log_level != "debug":  # megatron lists every parameter of every DDP bucket at info
        logging.getLogger("megatron").setLevel(logging.WARNING)
    return cfg, args, overrides


def _local(args: argparse.Namespace, overrides: list[str]) -> bool:
    """Whether the run's launch.mode is local (read quietly: the caller reports what is wrong)."""
    from megatron_sao.config import ConfigError, load_config

    try:
        return load_config(args.config, overrides).launch.mode == "local"
    except ConfigError:
        return False


def _parse(p: argparse.ArgumentParser, rest: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own flags, and the rest as config overrides (--section.key VALUE); a flag that is neither (no
    section in its name) ends the command, named with the command's flag it is closest to (exit 2)."""
    args, overrides = p.parse_known_args(rest)
    for token in overrides:
        if token.startswith("--") and "." not in token.split("=", 1)[0]:
            flag = token.split("=", 1)[0]
            known = [o for a in p._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            p.error(f"unknown flag {flag}: {hint}(its flags: {', '.join(known)}; config overrides are "
                    "--section.key VALUE)")  # fmt: skip
    return args, overrides


@command("plan")
def _plan(ns: argparse.Namespace, rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_sao plan", description="capacity plan of a config")
    p.add_argument("config", help="the run's YAML/TOML config")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the cluster (all roles)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one learner GPU")
    p.add_argument("--engine-gpu-mem-gb", type=float, default=None, help="engine GPUs' memory (default: the same)")
    p.add_argument("--ib-gbps", type=float, default=400.0, help="network bandwidth into one GPU, Gb/s")
    p.add_argument("--hf-config", default=None, help="config.json (or HF directory) of the model; default: "
                   "model.hf_path, then hf_config.json beside CONFIG")  # fmt: skip
    p.add_argument("--delta-density", type=float, default=None, help="engine-dtype units changed per push, for "
                   "the deltas' paths (default: measured at the paper's lr 1e-6: bf16 0.0114, FP8 0.0017)")  # fmt: skip
    args, overrides = _parse(p, rest)
    if args.delta_density is not None and not 0.0 <= args.delta_density <= 1.0:
        p.error(f"--delta-density {args.delta_density:g}: a share of units, in [0, 1]")
    cfg = _read_config(args.config, overrides)
    if cfg is None:
        return 2
    from megatron_sao.plan.plan import Hardware, make_plan, read_hf_config, render

    hw = Hardware(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb,
                  engine_gpu_mem_gb=args.engine_gpu_mem_gb, ib_gbps=args.ib_gbps)  # fmt: skip
    try:  # a config.json that is missing, damaged or of a family this project cannot train: exit 2, not "no fit"
        plan = make_plan(cfg, read_hf_config(cfg, args.config, args.hf_config), hw, args.delta_density)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(plan, cfg, hw, args.config), end="")
    return 0 if plan.fits else 1


@command("run")
def _run(ns: argparse.Namespace, rest: list[str]) -> int:
    loaded = _load("run", rest, launch=True)
    if loaded is None:
        return 2
    cfg, args, overrides = loaded
    from megatron_sao.distributed.dirlock import DirLock, DirLocked
    from megatron_sao.engines.sglang_launcher import EngineStartError
    from megatron_sao.files import DiskFull
    from megatron_sao.learner.errors import NonFiniteTraining, NoProducers
    from megatron_sao.run.local import RoleFailed

    try:
        if cfg.launch.mode == "slurm":
            from megatron_sao.launch.slurm import dry_run, run_slurm

            if args.dry_run:
                print(dry_run(cfg, args.config, overrides))
                return 0
            with DirLock(cfg.launch.run_dir, "run"):
                return run_slurm(cfg, args.config, overrides)
        if args.dry_run:
            print("error: --dry-run shows a launch.mode=slurm plan; this config is launch.mode=local", file=sys.stderr)
            return 2
        from megatron_sao.config import load_config
        from megatron_sao.run.local import free_ports, run_local

        moved = free_ports(cfg, overrides)  # another run on this machine holds the default ports: take free ones
        if moved:
            overrides = [*overrides, *moved]
            cfg = load_config(args.config, overrides)
        with DirLock(cfg.launch.run_dir, "run"):  # before anything is written: one run per run dir
            summary = run_local(cfg, args.config, overrides)
    except (ValueError, EngineStartError, DirLocked, DiskFull) as e:  # a setting to fix (named), an engine that
        print(f"error: {e}", file=sys.stderr)  # failed, a full disk
        return 2
    except (NonFiniteTraining, NoProducers, RoleFailed) as e:  # the run could not go on: what stopped it, named
        print(f"error: {e}", file=sys.stderr)
        return 1
    from megatron_sao.run.plot import plot_runs
    from megatron_sao.run.summary import describe, summarize

    if summary.get("version") is not None:  # (a torchrun learner reports only its seconds)
        stopped = f", stopped by {summary['stopped']}" if summary.get("stopped") else ""
        print(f"[run] done: version {summary['version']} after {summary.get('steps', 0)} step(s) in this "
              f"run{stopped}; checkpoints in {summary.get('save_dir')}", flush=True)  # fmt: skip
    run_dir = Path(cfg.launch.run_dir)
    done = summarize(run_dir)
    if done.get("policy_steps"):
        (plot,) = plot_runs([run_dir], run_dir, figures=["reward"])
        print(f"[run] reward plot: {plot}", flush=True)
    print(describe(done), flush=True)
    return 0  # also after a clean stop (SIGTERM / STOP): the learner checkpointed and the children were stopped


@command("submit")
def _submit(ns: argparse.Namespace, rest: list[str]) -> int:
    loaded = _load("submit", rest, launch=True)
    if loaded is None:
        return 2
    cfg, args, overrides = loaded
    from megatron_sao.launch.nodemap import NodeMapError
    from megatron_sao.launch.sbatch import render_sbatch, submit
    from megatron_sao.launch.slurm import dry_run

    if cfg.launch.mode != "slurm":  # submitting is asking for Slurm: the job runs the config as launch.mode=slurm
        print(f"[submit] {args.config} is launch.mode={cfg.launch.mode}; the job runs it with --launch.mode slurm",
              flush=True)  # fmt: skip
        overrides = [*overrides, "--launch.mode", "slurm"]
        cfg = _read_config(args.config, overrides)
        if cfg is None:
            return 2
    try:
        plan = dry_run(cfg, args.config, overrides)  # the node map must fit before anything is queued
    except NodeMapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(render_sbatch(cfg, args.config, overrides))
        print(plan)
        return 0
    try:
        script, job, code = submit(cfg, args.config, overrides, wait=args.wait)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[submit] job {job}: {script}; its output: {script.parent / 'logs' / f'slurm-{job}.out'}", flush=True)
    if args.wait:
        from megatron_sao.files import METRICS_FILE
        from megatron_sao.run.summary import summarize

        run_dir = script.parent  # <run_dir>/slurm.sbatch
        steps = int(summarize(run_dir).get("policy_steps") or 0)
        print(f"[submit] job {job} ended with {code}; policy steps in {run_dir}: {steps}", flush=True)
        if code == 0 and not steps:
            print(f"error: job {job} exited 0 but trained nothing (no policy step in {run_dir / METRICS_FILE}); "
                  f"read {run_dir / 'logs' / f'slurm-{job}.out'}", file=sys.stderr)  # fmt: skip
            return 1
    return code


@command("learn")
def _learn(ns: argparse.Namespace, rest: list[str]) -> int:
    loaded = _load("learn", rest, engines=True)
    if loaded is None:
        return 2
    cfg, args, _ = loaded
    from megatron_sao.distributed.dirlock import DirLocked
    from megatron_sao.files import DiskFull
    from megatron_sao.learner.checkpoint import CheckpointError
    from megatron_sao.learner.errors import NonFiniteTraining, NoProducers
    from megatron_sao.run.learn import learn

    urls = [u for u in args.engines.split(",") if u] or list(cfg.rollout.engine_urls)
    try:
        ready = Path(args.ready_file) if args.ready_file else None
        summary = learn(cfg, urls, on_ready=ready.touch if ready else None, critic_bridge=args.critic_bridge)
    except (NonFiniteTraining, NoProducers) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (DirLocked, DiskFull, CheckpointError) as e:  # CheckpointError: e.g. a full learner.save_dir, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(f"[learner] done: {summary}", flush=True)
    return 0  # also after a clean stop (SIGTERM / STOP): it checkpointed; the log says "stopped by"


@command("critic")
def _critic(ns: argparse.Namespace, rest: list[str]) -> int:
    loaded = _load("critic", rest)
    if loaded is None:
        return 2
    cfg, args, _ = loaded
    from megatron_sao.files import DiskFull
    from megatron_sao.learner.errors import NonFiniteTraining
    from megatron_sao.run.critic import serve

    try:
        serve(cfg, args.bridge)
    except (NonFiniteTraining, ValueError, DiskFull) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


@command("rollout")
def _rollout(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.rollout.cli import main as rollout_main

    return rollout_main(rest)


@command("ledger")
def _ledger(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.files import TRAJECTORIES_FILE
    from megatron_sao.run.ledger import check_ledger, dropped_vs_trained

    p = argparse.ArgumentParser(prog="python -m megatron_sao ledger", description="check a run's trajectory ledger")
    p.add_argument("run_dir", help="the run directory (launch.run_dir)")
    p.add_argument("--spool-dir", default=None, help="bus.spool_dir when not <run_dir>/spool")
    p.add_argument("--stale-log", default=None, help="the bus's stale.jsonl when not <run_dir>/stale.jsonl")
    args = p.parse_args(rest)
    if not (Path(args.run_dir) / TRAJECTORIES_FILE).is_file():
        print(f"error: {args.run_dir}/{TRAJECTORIES_FILE} does not exist: is it a run directory?", file=sys.stderr)
        return 2
    report = check_ledger(args.run_dir, args.spool_dir, args.stale_log)
    print(report.describe())
    if (compared := dropped_vs_trained(args.run_dir, args.stale_log)) is not None:
        print(compared)
    return 0 if report.ok else 1


@command("eval")
def _eval(ns: argparse.Namespace, rest: list[str]) -> int:
    """`python -m megatron_sao eval CONFIG [--checkpoint PATH|RUN_DIR] [--k v ...]`: held-out evaluation of a
    checkpoint (default: the config's run dir's latest) on engines started for it; prints a table, writes
    <run_dir>/eval/results.jsonl."""
    loaded = _load("eval", rest)
    if loaded is None:
        return 2
    cfg, args, _ = loaded

    from megatron_sao.engines.sglang_launcher import EngineStartError
    from megatron_sao.run.evaluate import evaluate_checkpoint, table

    checkpoint = args.checkpoint if args.checkpoint is not None else cfg.launch.run_dir
    if checkpoint != "none" and not Path(checkpoint).exists():  # before anything is made or started
        flag = "--checkpoint" if args.checkpoint is not None else "launch.run_dir (the default --checkpoint)"
        print(f"error: {flag} {checkpoint}: no such file or directory; give a run dir, a save dir, one checkpoint, "
              "or 'none' for the initial weights", file=sys.stderr)  # fmt: skip
        return 2
    try:
        result, what = evaluate_checkpoint(cfg, None if checkpoint == "none" else checkpoint)
    except (ValueError, EngineStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(result, what), end="")
    out = Path(cfg.launch.run_dir) / "eval" / "results.jsonl"
    from megatron_sao.files import JsonlAppender

    results = JsonlAppender(out, "launch.run_dir")
    results.write({"checkpoint": what, "time": time.time(), **result.as_record()})
    results.close()
    print(f"[eval] appended to {out}", flush=True)
    if result.given_up:
        print("error: the evaluation was given up (eval.timeout_s, or the engines kept changing version)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


@command("plot")
def _plot(ns: argparse.Namespace, rest: list[str]) -> int:
    from megatron_sao.run.plot import FIGURES, plot_runs

    p = argparse.ArgumentParser(prog="python -m megatron_sao plot", description="PNGs of runs' metrics.jsonl")
    p.add_argument("run_dirs", nargs="+", help="run directories (launch.run_dir); several are overlaid")
    p.add_argument("--out", default=None, help="where the PNGs go (default: <first run_dir>/plots)")
    p.add_argument("--labels", default=None, help="comma-separated, one per run (default: directory names)")
    p.add_argument("--figures", default=",".join(FIGURES), help=f"which of {', '.join(FIGURES)}")
    args = p.parse_args(rest)
    try:
        written = plot_runs(args.run_dirs, args.out or Path(args.run_dirs[0]) / "plots",
                            args.labels.split(",") if args.labels else None, args.figures.split(","))  # fmt: skip
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m megatron_sao", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=sorted(COMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:  # named, with the command it is closest to (argparse 3.11 only lists the choices)
        if argv[0].startswith("-"):
            parser.error(f"unknown flag {argv[0]}: a command comes first, its flags after it")
        close = difflib.get_close_matches(argv[0], sorted(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        parser.error(f"unknown command {argv[0]}: {hint}(commands: {', '.join(sorted(COMMANDS))})")
    ns = parser.parse_args(argv[:1])
    return COMMANDS[ns.command](ns, argv[1:])
