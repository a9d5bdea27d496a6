"""The README, walked as a new user would on a fresh clone (slow tier, ~15 min on 2 cores): `./launch.sh --help`
first (it must say what launch.sh does and install nothing), then every command of the README's ```bash and ```console
blocks as written, each ending as the README says: `./launch.sh` (it makes the venv and runs the agentic main job
end to end) ends with its `[run] reward ... -> ...` line; `./tests/run.sh` installs what the tests need and runs
pytest (here on one file, `-- tests/test_cli_help.py`: the whole tier is CI's job); `tensorboard --logdir` serves the
run (asked over HTTP, then stopped); `plot` draws the PNGs. The first-screen promises are checked too: the quickstart
block holds exactly the two set-up commands."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_sao.distributed.spawn import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(2700)]  # venv + main job + tests
REPO = Path(__file__).resolve().parents[2]


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash and ```console blocks, in order (comments dropped)."""
    commands = []
    for block in re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_quickstart_holds_the_two_set_up_commands() -> None:
    commands = readme_commands((REPO / "README.md").read_text())
    assert commands[:2] == ["./launch.sh", "./tests/run.sh"], commands


def _run(argv: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "SAO_", "PYTHONPATH"))}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)


def _tensorboard(argv: list[str], clone: Path) -> None:
    """Serve the run on a free port, ask it over HTTP, stop it."""
    port = find_free_port()
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=clone, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as answer:
                    assert answer.status == 200
                    return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"tensorboard did not serve: {argv}") from None
                time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_new_user_walks_the_readme_on_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "megatron-sao"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=300)
    helped = _run(["./launch.sh", "--help"], clone, 120)
    assert helped.returncode == 0 and not (clone / ".venv").exists(), helped.stderr[-2000:]
    assert "./launch.sh " in "\n".join(helped.stdout.splitlines()[:3]), helped.stdout[:500]  # its own modes first
    for command in readme_commands((clone / "README.md").read_text()):
        argv = shlex.split(command)
        if argv[0] == "./tests/run.sh":
            argv += ["--", "tests/test_cli_help.py", "-q"]
        if "tensorboard" in argv[0]:
            _tensorboard(argv, clone)
            continue
        done = _run(argv, clone, 3600)
        said = f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert done.returncode == 0, said
        if argv == ["./launch.sh"]:
            assert re.search(r"\[run\] reward [\d.]+ .*-> [\d.]+", done.stdout), said
            assert (clone / "runs" / "tiny_agentic" / "samples.jsonl").is_file()
        elif argv[0] == "./tests/run.sh":
            assert re.search(r"\d+ passed", done.stdout), said
        elif "plot" in argv:
            assert list((clone / "runs" / "tiny_agentic").glob("*.png")), said
