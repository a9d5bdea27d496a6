"""What every experiment shares: one arm's run through the real processes, its records, and the summaries and
figures built on them.

A run is the project's own engine, learner and rollout worker, started as separate processes the way
benchmarks/pipeline_efficiency.py starts them (engine and worker pinned to core 0, learner to core 1, one thread
each, so they behave like separate accelerators), with the arm's overrides on top of an example config. While it
runs, the engine's counters are polled into <run_dir>/engine.jsonl (time, generated tokens, busy seconds), so
rewards can be read against generated tokens as well as wall time; a run with a token budget is stopped once
the engine has generated that many tokens (value pre-training's included: every arm pays for what it generates).
A finished run leaves <run_dir>/run.json; asking for the same run again (same config, overrides, seed and
budget) reads it back instead of training again, so experiments that share an arm (the ablations' `sao` row is
the learning-efficiency `sao` arm) run it once.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
AGENTIC = REPO / "examples" / "tiny_agentic" / "config.yaml"
PRETRAINING = ("--algo.value.pretrain_batch", "0", "--algo.value.pretrain_plateau_steps", "5",
               "--algo.value.pretrain_min_explained_variance", "0.3")  # fmt: skip
"""Value pre-training as the experiments were measured with it (the library's defaults: batches of
learner.trajectories_per_step), whatever the main job's config chooses; an arm's own overrides come after."""
STYLE = REPO / "examples" / "tiny_cpu" / "config.yaml"
RUNS = REPO / "runs" / "experiments"
PRIMARY = "eval/success_rate"
"""The on-policy measure (issue 47): of a run's sampled held-out evaluation, the share of samples solved."""
RESULTS = REPO / "docs" / "results.md"
FIGURES = REPO / "docs" / "results"


def machine() -> str:
    """One line naming the machine the numbers were measured on."""
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {mem:.0f} GiB, no GPU"


def role_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pinned(core: int, cmd: list[str]) -> list[str]:
    """`cmd` bound to one core (taskset), where there is more than one and taskset exists."""
    return (["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []) + cmd


def warm_agentic_model(
    work: Path = RUNS, env_options: dict[str, Any] | None = None, name: str = "warm_agentic",
    warm_args: tuple[str, ...] = (),
) -> Path:  # fmt: skip
    """The main job's starting point: a random tiny qwen3_moe warm-started on key_chain demonstrations (cached);
    `env_options`: a key_chain variant's (its demonstrator's), cached under `name`; `warm_args`: more
    tools/warm_start.py arguments."""
    from megatron_sao.models.tiny import make_tiny_model

    base = work / "base_agentic"
    if not (base / "config.json").is_file():
        make_tiny_model("qwen3_moe", base, hidden=128, force=True)
    warm = work / name
    cmd = [sys.executable, str(REPO / "tools" / "warm_start.py"), "--config", str(AGENTIC), "--base", str(base),
           "--out", str(warm)]  # fmt: skip
    cmd += list(warm_args)
    if env_options:
        cmd += ["--rollout.env.options", json.dumps(env_options)]
    done = subprocess.run(cmd, env=role_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"warm start failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return warm


STYLES = ["cute", "chuunibyou", "classical"]


def warm_style_model(work: Path = RUNS) -> Path:
    """The online-adaptation starting point: the style example's random tiny qwen3_moe (hidden 64) warm-started on
    sentences in every style alike (style_preference's demonstrator; cached), so that the reward, not the
    weights, picks the style -- as for a pre-trained LLM, which can write in all of them."""
    from megatron_sao.models.tiny import make_tiny_model

    base = work / "base_style"
    if not (base / "config.json").is_file():
        make_tiny_model("qwen3_moe", base, hidden=64, force=True)
    warm = work / "warm_style"
    cmd = [sys.executable, str(REPO / "tools" / "warm_start.py"), "--config", str(STYLE), "--base", str(base),
           "--out", str(warm), "--demos", "2000", "--steps", "300", "--mistake-rate", "0.1", "--threads", "1",
           "--rollout.env.options", json.dumps({"styles": STYLES})]  # fmt: skip
    done = subprocess.run(cmd, env=role_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"warm start failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return warm


@dataclass(frozen=True)
class RunSpec:
    """One arm, one seed: the example config, the overrides that make the arm, and when to stop."""

    label: str  # the arm's name in figures and tables
    config: Path
    model: Path
    overrides: tuple[str, ...]
    seed: int
    token_budget: int | None = None  # stop once the engine generated this many tokens; None: at learner.max_steps
    env_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 3600.0
    engine_args: tuple[str, ...] = ()  # more `python -m megatron_sao engine` flags (e.g. --dtype bfloat16)
    eval_prompts: int = 0  # > 0: at the budget the learner checkpoints and stops, and that checkpoint is evaluated
    eval_samples: int = 4  # on eval_prompts held-out prompts: greedy (one sample), sampled (this many, temperature 1)

    @property
    def key(self) -> dict[str, Any]:
        key = {"label": self.label, "config": str(self.config.relative_to(REPO)), "overrides": list(self.overrides),
               "seed": self.seed, "token_budget": self.token_budget, "env_options": self.env_options}  # fmt: skip
        if self.eval_prompts:
            key["eval"] = [self.eval_prompts, self.eval_samples]
        return {**key, "engine_args": list(self.engine_args)} if self.engine_args else key


@dataclass
class Run:
    """A finished run's records, read back from its directory."""

    spec: RunSpec
    run_dir: Path
    wall_s: float
    steps: list[dict[str, Any]]  # metrics.jsonl records of policy steps
    records: list[dict[str, Any]]  # every metrics.jsonl record (pre-training and pushes included)
    trajectories: list[dict[str, Any]]  # the learner's ledger: one line per trained trajectory, in training order
    engine: np.ndarray  # [n, 3]: seconds since the run's start, generated tokens, busy seconds
    start: float  # unix time the rollout worker started
    evals: dict[str, dict[str, float]] = field(default_factory=dict)  # "greedy" / "sampled": the held-out records

    def tokens_at(self, times: np.ndarray) -> np.ndarray:
        """Generated tokens at `times` (seconds since the start), interpolated on the engine's counter."""
        return np.interp(times, self.engine[:, 0], self.engine[:, 1])

    def reward_series(self, pretrain: bool = False) -> dict[str, np.ndarray]:
        """Per trained trajectory, in order of finishing: seconds since start, generated tokens then, reward, and
        the newest weight version that generated it. Value pre-training's trajectories only when asked."""
        rows = sorted(
            (t for t in self.trajectories if pretrain or not t.get("pretrain")), key=lambda t: t["finished_at"]
        )
        secs = np.array([t["finished_at"] - self.start for t in rows], dtype=float)
        return {
            "time": secs,
            "tokens": self.tokens_at(secs),
            "reward": np.array([t["reward"] for t in rows], dtype=float),
            "version": np.array([(t["versions"] or [0, 0])[1] for t in rows], dtype=float),
        }


def run_arm(spec: RunSpec, run_dir: Path, log: Any = print) -> Run:
    """Train one arm (or read the finished run back, when `run_dir/run.json` says it is this spec)."""
    done = run_dir / "run.json"
    if done.is_file() and json.loads(done.read_text()).get("spec") == spec.key:
        return load_run(spec, run_dir)
    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.engines.client import SGLangClient
    from megatron_sao.files import STOP_FILE

    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "logs").mkdir(parents=True)
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = [
        "--model.hf_path", str(spec.model), "--launch.run_dir", str(run_dir), "--learner.seed", str(spec.seed),
        "--bus.bind", f"tcp://127.0.0.1:{find_free_port()}", "--weight_sync.master_port", str(find_free_port()),
        "--rollout.cursor_state", str(run_dir / "cursor.json"), *(PRETRAINING if spec.config == AGENTIC else ()),
        *spec.overrides,
    ]  # fmt: skip
    if spec.env_options:
        overrides += ["--rollout.env.options", json.dumps(spec.env_options)]
    if spec.token_budget is not None:
        # the token budget ends the run, not a step count; no checkpoint before it, so producers hold everything
        overrides += ["--learner.max_steps", "100000", "--learner.save_interval", "100000",
                      "--bus.max_uncommitted", "1000000000"]  # fmt: skip
    py = [sys.executable, "-m", "megatron_sao"]
    logs = {name: open(run_dir / "logs" / f"{name}.log", "wb") for name in ("engine", "learner", "rollout")}  # noqa: SIM115
    engine_cmd = [*py, "engine", "--model", str(spec.model), "--port", str(port), "--threads", "1",
                  "--max-running-requests", "64", "--random-seed", str(spec.seed), *spec.engine_args]  # fmt: skip
    procs = [subprocess.Popen(pinned(0, engine_cmd), stdout=logs["engine"], stderr=subprocess.STDOUT, env=role_env())]
    client = SGLangClient(url)
    poll_stop = threading.Event()
    budget_hit = threading.Event()
    t0 = time.time()
    try:
        deadline = time.monotonic() + 300
        while not client.health(timeout_s=1.0):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{spec.label}: the engine did not start: {_tail(run_dir / 'logs' / 'engine.log')}")
            time.sleep(0.3)
        ready = run_dir / "learner.ready"
        learn_cmd = [*py, "learn", str(spec.config), "--engines", url, "--ready-file", str(ready), *overrides]
        procs.append(subprocess.Popen(pinned(1, learn_cmd), stdout=logs["learner"], stderr=subprocess.STDOUT,
                                      env=role_env()))  # fmt: skip
        while not ready.exists():  # the clock starts when the learner can take trajectories, as for run/local.py
            if procs[1].poll() is not None or time.monotonic() > deadline + 300:
                raise RuntimeError(
                    f"{spec.label}: the learner did not start: {_tail(run_dir / 'logs' / 'learner.log')}"
                )
            time.sleep(0.2)
        t0 = time.time()
        procs.append(subprocess.Popen(pinned(0, [*py, "rollout", str(spec.config), "--engines", url, *overrides]),
                                      stdout=logs["rollout"], stderr=subprocess.STDOUT, env=role_env()))  # fmt: skip
        poller = threading.Thread(
            target=_poll_engine, args=(client, run_dir / "engine.jsonl", t0, spec.token_budget, poll_stop, budget_hit)
        )
        poller.start()
        learner = procs[1]
        while learner.poll() is None and not budget_hit.is_set():
            if procs[2].poll() not in (None, 0):
                raise RuntimeError(
                    f"{spec.label}: the rollout worker failed: {_tail(run_dir / 'logs' / 'rollout.log')}"
                )
            if time.time() - t0 > spec.timeout_s:
                raise RuntimeError(f"{spec.label}: no end after {spec.timeout_s:.0f} s (see {run_dir / 'logs'})")
            time.sleep(0.2)
        wall = time.time() - t0
        if not budget_hit.is_set() and learner.returncode != 0:
            raise RuntimeError(f"{spec.label}: the learner failed: {_tail(run_dir / 'logs' / 'learner.log')}")
        if spec.eval_prompts and budget_hit.is_set():  # the learner finishes its step and saves it: evaluated below
            (run_dir / STOP_FILE).write_text("the token budget\n")
            if learner.wait(timeout=600) != 0:
                raise RuntimeError(f"{spec.label}: the learner did not checkpoint at the budget: "
                                   f"{_tail(run_dir / 'logs' / 'learner.log')}")  # fmt: skip
    finally:
        poll_stop.set()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    evals = evaluate_run(spec, run_dir, overrides) if spec.eval_prompts else {}
    done.write_text(json.dumps({"spec": spec.key, "wall_s": wall, "start": t0, "evals": evals}) + "\n")
    run = load_run(spec, run_dir)
    tokens = int(run.engine[-1, 1])
    log(f"  {spec.label} seed {spec.seed}: {len(run.steps)} policy steps, {tokens} tokens in {wall:.0f} s")
    return run


def evaluate_run(spec: RunSpec, run_dir: Path, overrides: list[str]) -> dict[str, dict[str, float]]:
    """The on-policy measure: the checkpoint the run stopped at, on `spec.eval_prompts` held-out prompts, greedy and
    sampled (`python -m megatron_sao eval`, on an engine of its own: not charged to the training budget)."""
    out: dict[str, dict[str, float]] = {}
    modes = {
        "greedy": ("--eval.sampling.temperature", "0", "--eval.samples_per_prompt", "1"),
        "sampled": ("--eval.sampling.temperature", "1", "--eval.samples_per_prompt", str(spec.eval_samples)),
    }
    for mode, args in modes.items():
        cmd = [sys.executable, "-m", "megatron_sao", "eval", str(spec.config), "--checkpoint", str(run_dir),
               *overrides, "--eval.num_prompts", str(spec.eval_prompts), "--eval.budget", "1.0",
               "--eval.timeout_s", "3000", *args]  # fmt: skip
        with open(run_dir / "logs" / f"eval_{mode}.log", "wb") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=role_env()).returncode
        if code != 0:
            raise RuntimeError(f"{spec.label}: the {mode} evaluation failed: "
                               f"{_tail(run_dir / 'logs' / f'eval_{mode}.log')}")  # fmt: skip
        out[mode] = _jsonl(run_dir / "eval" / "results.jsonl")[-1]
    return out


def _poll_engine(
    client: Any, path: Path, t0: float, budget: int | None, stop: threading.Event, hit: threading.Event
) -> None:
    """Every 0.25 s: the engine's generated tokens and busy seconds, as JSON lines; sets `hit` at the budget."""
    from megatron_sao.engines.client import EngineError

    with path.open("w") as out:
        while not stop.is_set():
            try:
                load = client.server_info()["load"]
            except (EngineError, ConnectionError, TimeoutError):  # the engine is going away at the end of the run
                break
            out.write(json.dumps({"t": time.time() - t0, "tokens": load["generated_tokens"], "busy_s": load["busy_s"]}))
            out.write("\n")
            out.flush()
            if budget is not None and load["generated_tokens"] >= budget:
                hit.set()
                break
            stop.wait(0.25)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else "(no log)"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the stop at the budget
            continue
    return out


def load_run(spec: RunSpec, run_dir: Path) -> Run:
    meta = json.loads((run_dir / "run.json").read_text())
    records = _jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "step/trajectories" in r and "loss/policy" in r]
    trajectories = [t for t in _jsonl(run_dir / "trajectories.jsonl") if "id" in t]
    polled = _jsonl(run_dir / "engine.jsonl")
    engine = np.array([[p["t"], p["tokens"], p["busy_s"]] for p in polled] or [[0.0, 0.0, 0.0]], dtype=float)
    return Run(
        spec,
        run_dir,
        float(meta["wall_s"]),
        steps,
        records,
        trajectories,
        engine,
        float(meta["start"]),
        meta.get("evals", {}),
    )


# ---------------------------------------------------------------------------------------------- summaries


def rolling(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    if y.size == 0:
        return y
    c = np.cumsum(np.insert(y.astype(float), 0, 0.0))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def on_grid(x: np.ndarray, y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """y(x) on `grid` (step-wise: the last value at or before each point; NaN before the first and past the end)."""
    if x.size == 0:
        return np.full(grid.shape, np.nan)
    i = np.searchsorted(x, grid, side="right") - 1
    out = np.where(i >= 0, y[np.clip(i, 0, None)], np.nan)
    return np.where(grid <= x[-1], out, np.nan)


def first_reach(x: np.ndarray, y: np.ndarray, level: float, skip: int = 0) -> float | None:
    """The first x where y >= level, not looking at the first `skip` points (a rolling mean over fewer values than
    its window is too noisy to count); None when it never gets there."""
    hit = np.flatnonzero(y[skip:] >= level) + skip
    return float(x[hit[0]]) if hit.size else None


def mean_spread(values: Sequence[float | None]) -> str:
    """'mean ± std (n/m)' over the seeds that got a value; '—' when none did."""
    got = [v for v in values if v is not None and np.isfinite(v)]
    if not got:
        return "not reached"
    mean = statistics.fmean(got)
    big = abs(mean) >= 1000  # token counts: whole numbers
    text = f"{mean:,.0f}" if big else f"{mean:.3g}"
    if len(got) > 1:
        sd = statistics.stdev(got)
        text += f" ± {sd:,.0f}" if big else f" ± {sd:.2g}"
    return text + (f" ({len(got)}/{len(values)} seeds)" if len(got) < len(values) else "")


def chosen_arms(spec: str, known: dict[str, Any]) -> list[str]:
    """The arms a comma-separated --arms names, in its order; SystemExit naming any unknown one."""
    arms = [a for a in spec.split(",") if a]
    unknown = sorted(set(arms) - set(known))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(known)}")
    return arms


def measured(values: Sequence[Any]) -> str:
    """mean_spread of the values a measurement gave ('–' when none did: a measure not taken, not a level missed)."""
    return "–" if all(v is None for v in values) else mean_spread([v for v in values if v is not None])


def write_section(results: Path, name: str, body: str) -> None:
    """Replace the text between `<!-- experiments:NAME -->` and `<!-- /experiments:NAME -->` in `results` (appended,
    with the markers, when they are not there yet): the tables in docs/results.md are what the scripts printed."""
    start, end = f"<!-- experiments:{name} -->", f"<!-- /experiments:{name} -->"
    text = results.read_text() if results.is_file() else "# Results\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)


def figure_link(results: Path, png: Path) -> str:
    """A markdown image whose path is relative to the results file."""
    return f"![{png.stem}]({os.path.relpath(png, results.parent)})"


def add_common_args(p: Any, runs: Path, quick: dict[str, Any]) -> None:
    """The options every experiment has: --quick (what it sets), where the runs, the table and the figures go."""
    p.add_argument("--quick", action="store_true", help=f"a fast end-to-end pass: {quick}")
    p.add_argument("--runs", type=Path, default=runs, help="where the raw runs go")
    p.add_argument("--results", type=Path, default=RESULTS, help="the markdown file the table goes into")
    p.add_argument("--figures", type=Path, default=FIGURES, help="where the PNG and JSON go")


def apply_quick(args: Any, quick: dict[str, Any]) -> str:
    """With --quick, set the quick values; the suffix of the outputs' names ("_quick" or "")."""
    if args.quick:
        for k, v in quick.items():
            setattr(args, k, v)
    return "_quick" if args.quick else ""


def save_figure(fig: Any, png: Path, title: str) -> None:
    """Title, lay out, write and close a matplotlib figure."""
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    pyplot().close(fig)


def publish(name: str, results: Path, png: Path, table: str, note: str, data: dict[str, Any]) -> None:
    """What every experiment ends with: print its table; write <figures>/<name>.json (the command, the machine and
    `data`); put the command, the figure, the table and `note` into `results` between the `name` markers."""
    print(table)
    record = {"command": command_line(), "machine": machine(), **data}
    (png.parent / f"{name}.json").write_text(json.dumps(record) + "\n")
    body = f"```bash\n{command_line()}\n```\n\n{figure_link(results, png)}\n\n{table}\n\nMachine: {machine()}. {note}"
    write_section(results, name, body)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
