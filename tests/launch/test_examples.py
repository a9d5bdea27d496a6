"""The cluster examples as a user meets them: `--dry-run` of each at its stated node count matches its golden output
(the node map and every srun / torchrun / engine / worker command with its environment), the example's
slurm.sbatch is what `./launch.sh submit` writes for it, and every command its README gives runs in dry-run form.
SAO_UPDATE_GOLDEN=1 rewrites the golden files and the sbatch scripts (review the diff)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.config import load_config
from megatron_sao.launch.sbatch import render_sbatch
from megatron_sao.launch.slurm import dry_run
from megatron_sao.launch.steps import REPO

EXAMPLES = ("qwen3_30b", "glm_750b")
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SAO_UPDATE_GOLDEN") == "1"


def _check(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing: SAO_UPDATE_GOLDEN=1 writes it"
    assert text == path.read_text(), f"{path} differs from what the code renders (SAO_UPDATE_GOLDEN=1 to accept)"


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)


@pytest.mark.parametrize("example", EXAMPLES)
def test_dry_run_matches_the_golden_plan(example: str) -> None:
    config = f"examples/{example}/config.yaml"
    cfg = load_config(REPO / config)
    text = dry_run(cfg, config, [], python="python").replace(str(REPO), "<repo>")
    _check(GOLDEN / f"{example}.txt", text + "\n")
    assert text.count("srun --overlap") == cfg.rollout.num_engines + 1 + len(re.findall(r"\[rollout-\d+\]", text))


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_example_sbatch_is_what_submit_writes(example: str) -> None:
    config = f"examples/{example}/config.yaml"
    cfg = load_config(REPO / config)
    text = render_sbatch(cfg, config, [])
    _check(REPO / "examples" / example / "slurm.sbatch", text)
    assert f"#SBATCH --nodes={cfg.launch.total_nodes}" in text and f"exec ./launch.sh run {config}" in text


def _readme_commands(example: str) -> list[str]:
    """The shell commands of the README's ```bash blocks (continuation lines joined; comments dropped)."""
    text = (REPO / "examples" / example / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


@pytest.mark.multiproc
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_readme_command_runs_in_dry_run_form(example: str, tmp_path: Path) -> None:
    """Each command the README gives, with --dry-run where it takes one (launcher, converters) or --help where the
    tool only reads (tensorboard, the plot command), exits 0 -- so a renamed flag or a moved file breaks here."""
    commands = _readme_commands(example)
    assert len(commands) >= 5, commands
    for command in commands:
        argv = shlex.split(command)
        argv = [sys.executable if a == "python" else a for a in argv]
        if argv[0] == "sbatch":
            argv = [sys.executable, "-m", "megatron_sao", "submit", _config_of(argv), "--dry-run"]
        elif "--dry-run" not in argv:
            argv.append("--dry-run")
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def _config_of(sbatch_argv: list[str]) -> str:
    script = (REPO / sbatch_argv[-1]).read_text()
    return re.search(r"exec ./launch.sh run (\S+)", script).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("example", EXAMPLES)
def test_weight_sync_agent_puts_a_push_agent_beside_every_engine_part(example: str) -> None:
    """weight_sync.agent: each engine part gets an agent step on its node, at the engine's port + the offset, on the
    engine's GPUs, its node-rank 0 agent's URL being what the learner pushes to; the parts of an agent spanning
    nodes meet at its engine's node 0."""
    from megatron_sao.engines.protocol import agent_url
    from megatron_sao.launch.nodemap import plan
    from megatron_sao.launch.slurm import placeholder_nodes
    from megatron_sao.launch.steps import build_steps

    config = f"examples/{example}/config.yaml"
    cfg = load_config(REPO / config, ["--weight_sync.agent", "true"])
    nodes = plan(cfg, placeholder_nodes(cfg.launch.total_nodes))
    steps = build_steps(cfg, config, [], nodes, python="python")
    engines = [s for s in steps if s.role == "engine"]
    agents = [s for s in steps if s.role == "agent"]
    assert len(agents) == len(engines) and [a.nodes for a in agents] == [e.nodes for e in engines]
    offset, sg = cfg.weight_sync.agent_port_offset, cfg.rollout.sglang
    for engine, agent in zip(engines, agents):
        assert agent.name == engine.name.replace("engine", "agent")
        cmd = list(agent.command)
        port = int(cmd[cmd.index("--port") + 1])
        assert port == int(engine.command[engine.command.index("--port") + 1]) + offset
        assert cmd[cmd.index("--base-gpu-id") + 1] == engine.command[engine.command.index("--base-gpu-id") + 1]
        assert cmd[cmd.index("--device") + 1] == "cuda"
        assert (agent.url is None) == (engine.url is None)
        if engine.url:
            assert agent.url == agent_url(engine.url, offset) and cmd[cmd.index("--engine") + 1] == engine.url
        if sg.nnodes > 1:
            assert cmd[cmd.index("--nnodes") + 1] == str(sg.nnodes)
            addr = cmd[cmd.index("--dist-init-addr") + 1]
            assert addr.rsplit(":", 1)[0] == engine.command[engine.command.index("--dist-init-addr") + 1].rsplit(":")[0]
        else:
            assert "--nnodes" not in cmd
