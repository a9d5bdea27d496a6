"""`./launch.sh submit CONFIG [--k v ...] [--dry-run] [--wait]`: the sbatch script of a launch.mode=slurm run,
written to <run_dir>/slurm.sbatch and submitted. The script asks for the nodes the roles need (launch.nnodes +
rollout_nodes + worker_nodes) and launch.slurm's options, runs launch.slurm.setup, and execs
`./launch.sh run CONFIG` (launch/slurm.py), which gets SIGTERM launch.slurm.signal_grace_s before the time limit.
The examples' slurm.sbatch files are this rendering, kept equal by a test."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from megatron_sao.config.tree import SAOConfig
from megatron_sao.launch.steps import REPO


def render_sbatch(
    cfg: SAOConfig, config_path: str, overrides: list[str], workdir: str | None = None, run_dir: Path | None = None
) -> str:
    """The script; `workdir`: where it runs ./launch.sh from (None: the directory sbatch was called in, which must
    then be the repository); `run_dir`: where its output goes (None: launch.run_dir as written)."""
    la, sl = cfg.launch, cfg.launch.slurm
    opts = [f"--job-name={sl.job_name}", f"--nodes={la.total_nodes}", "--ntasks-per-node=1"]
    if la.gpus_per_node:
        opts.append(f"--gpus-per-node={la.gpus_per_node}")
    if sl.exclusive:
        opts.append("--exclusive")
    opts += [f"--{name}={value}" for name, value in (("partition", sl.partition), ("account", sl.account),
                                                      ("time", sl.time)) if value]  # fmt: skip
    if sl.signal_grace_s:
        opts.append(f"--signal=B:TERM@{sl.signal_grace_s}")
    opts.append(f"--output={(run_dir or Path(la.run_dir)) / 'logs' / 'slurm-%j.out'}")
    opts += sl.sbatch_args
    lines = ["#!/bin/bash", f"# megatron-sao: {config_path} (written by ./launch.sh submit; docs/run.md)"]
    lines += [f"#SBATCH {opt}" for opt in opts]
    cd = shlex.quote(workdir) if workdir else '"${SLURM_SUBMIT_DIR}"'
    lines += ["set -euo pipefail", f"cd {cd}", *sl.setup]
    lines.append(f"exec ./launch.sh run {shlex.join([config_path, *overrides])}")
    return "\n".join(lines) + "\n"


def submit(cfg: SAOConfig, config_path: str, overrides: list[str], wait: bool = False) -> tuple[Path, int, int]:
    """Write <run_dir>/slurm.sbatch (run from this repository, the config made absolute) and sbatch it; (script,
    job id, sbatch's exit status). `wait`: block until the job ends (sbatch --wait: the status is the job's)."""
    config = str(Path(config_path).resolve())
    run_dir = REPO / cfg.launch.run_dir  # an absolute run_dir stays itself; a relative one is the launcher's (REPO)
    script = run_dir / "slurm.sbatch"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    script.write_text(render_sbatch(cfg, config, overrides, workdir=str(REPO), run_dir=run_dir))
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    except FileNotFoundError:
        raise RuntimeError("sbatch is not on PATH: submit from a Slurm login node (or print the script with "
                           "--dry-run and submit it yourself)") from None  # fmt: skip
    job = done.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise RuntimeError(f"sbatch {script} failed ({done.returncode}): {done.stderr.strip()}")
    return script, int(job), done.returncode
