"""Watching a run: one tiny SAO run (value pre-training, then policy steps) writes every key of the metrics schema
(files/metrics_schema.py) that applies to it and nothing the schema does not list; its TensorBoard events read back with
TensorBoard's own reader; `plot` draws non-empty PNGs for one run and two; the progress display falls back to
plain lines without a TTY; the rollout worker writes its own metrics, engines' included, each key in its schema; a
grpo run with the ppo_clip loss writes only listed keys; wandb offline gets the records; docs/run.md shows the
schemas as the code has them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.files.metrics_schema import RECORDS, SCHEMA, schema_entry, schema_table
from megatron_sao.run.display import StepDisplay
from tests.run.test_arms import ARMS, REPO, _cmd, _env, assert_ledger_ok


@pytest.fixture(scope="module")
def run_dir(tiny_hf_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("metrics") / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.max_steps", "3", "--algo.value.pretrain_samples", "8",
               "--learner.trajectories_per_step", "4", "--rollout.log_interval_s", "1", "--eval.interval", "2",
               "--eval.num_prompts", "2", "--eval.samples_per_prompt", "2")  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"reward plot: {run_dir / 'reward.png'}" in done.stdout and "generated tokens/s" in done.stdout
    assert_ledger_ok(run_dir)
    return run_dir


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
def test_every_schema_key_is_written_and_nothing_else(run_dir: Path) -> None:
    records = _records(run_dir)
    written = {k for r in records for k in r}
    unlisted = sorted(k for k in written if schema_entry(k) is None)
    assert not unlisted, f"written but not in files/metrics_schema.py: {unlisted}"
    for m in SCHEMA:
        if m.record == "learner" and m.when in ("step", "policy", "critic", "push", "pretrain", "eval"):  # a sao run's
            hit = [k for k in written if schema_entry(k) is m]
            assert hit, f"{m.key} ({m.when}) is in the schema but this run never wrote it"
    steps = [r for r in records if "step/trajectories" in r]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # pre-training steps count too
    assert [r["trajectories/consumed"] for r in steps] == [4 * (i + 1) for i in range(len(steps))]
    assert all(r["tokens/consumed"] > r["tokens/generated"] > 0 for r in steps)
    policy_steps = [r for r in steps if r["weight_version"] > 0]
    assert [r["sync/reason"] for r in policy_steps] == ["interval"] * 3  # weight_sync.interval 1: after every step
    assert sum("pretrain/samples" in r for r in steps) == 2 and steps[-1]["weight_version"] == 3


@pytest.mark.multiproc
def test_tensorboard_events_hold_the_reward(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "reward/mean" in tags and "loss/value" in tags and "dis/masked_frac" in tags
    reward = events.Scalars("reward/mean")
    steps = [r for r in _records(run_dir) if "step/trajectories" in r]
    assert [e.step for e in reward] == [r["step"] for r in steps]
    assert [round(e.value, 5) for e in reward] == [round(r["reward/mean"], 5) for r in steps]


@pytest.mark.multiproc
def test_plot_writes_pngs_for_one_and_two_runs(run_dir: Path, tmp_path: Path) -> None:
    assert (run_dir / "reward.png").stat().st_size > 1000  # the run drew it at its end
    for runs, labels in (([run_dir], []), ([run_dir, run_dir], ["--labels", "a,b"])):
        out = tmp_path / f"plots{len(runs)}"
        done = subprocess.run([sys.executable, "-m", "megatron_sao", "plot", *map(str, runs), "--out", str(out),
                               *labels], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        pngs = sorted(p.name for p in out.glob("*.png"))
        assert pngs == sorted(["reward.png", "masked_fraction.png", "staleness.png", "losses.png",
                               "explained_variance.png", "throughput.png", "throughput_wall.png"])  # fmt: skip
        assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / p).stat().st_size > 1000 for p in pngs)
    bad = subprocess.run([sys.executable, "-m", "megatron_sao", "plot", str(tmp_path / "nothing")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "metrics.jsonl does not exist" in bad.stderr


@pytest.mark.multiproc
def test_the_rollout_worker_writes_its_own_metrics(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "rollout_metrics_rollout-0.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["worker"] == "rollout-0" and last["rollout/trajectories"] > 0
    written = {k for r in records for k in r}
    unlisted = sorted(k for k in written if schema_entry(k, "rollout") is None)
    assert not unlisted, f"written by the worker but not in files/metrics_schema.py (record rollout): {unlisted}"
    for m in (m for m in SCHEMA if m.record == "rollout"):
        assert any(schema_entry(k, "rollout") is m for k in written), f"{m.key} is in the schema but never written"
    assert any(k.startswith("engine/http://") and k.endswith("/requests") for k in last)
    assert schema_entry("rollout/trajectories") is None  # a worker's key is not a learner key


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_ppo_clip_run_writes_only_listed_keys(tiny_hf_dir: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, *ARMS["grpo"], "--algo.grpo.policy_loss", "ppo_clip",
               "--learner.max_steps", "2")  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = {k for r in _records(run_dir) for k in r}
    unlisted = sorted(k for k in written if schema_entry(k) is None)
    assert not unlisted, f"written but not in files/metrics_schema.py: {unlisted}"
    ppo = {k for k in written if k.startswith("ppo/")}
    assert {"ppo/clipfrac", "ppo/approx_kl", "ppo/ratio_max"} <= ppo and not any(k.startswith("dis/") for k in written)
    for m in SCHEMA:
        if m.record == "learner" and m.when in ("group", "ppo"):
            assert any(schema_entry(k) is m for k in written), f"{m.key} ({m.when}) never written by a ppo_clip run"


def test_the_display_is_plain_lines_without_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    display = StepDisplay(max_steps=5, start=0, mode="auto")  # pytest's stdout is not a terminal
    display.step({"weight_version": 1, "reward/mean": 0.5}, "step 1/5 | reward 0.500")
    display.close()
    assert capsys.readouterr().out == "[learner] step 1/5 | reward 0.500\n"
    live = StepDisplay(max_steps=5, start=0, mode="rich")  # forced: updates the bar, prints no step line
    live.step({"weight_version": 2, "reward/mean": 0.25, "dis/masked_frac": 0.1}, "step 2/5")
    assert live.progress.tasks[0].completed == 2 and "masked 0.100" in live.progress.tasks[0].fields["facts"]
    live.close()


@pytest.mark.multiproc  # wandb starts its service process
def test_wandb_offline_gets_the_records(tmp_path: Path) -> None:
    from megatron_sao.run.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=False, wandb="offline")
    for i in range(3):
        log.write({"step": i + 1, "time": 0.0, "reward/mean": 0.1 * i, "sync/reason": "interval"})
    log.close()
    import wandb

    wandb.teardown()  # waits for wandb's service process to exit: its writer buffers the run file until then
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"reward/mean" in run.read_bytes()  # the history records, in wandb's own offline format
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_full_disk_under_tensorboard_is_named_and_metrics_stay_whole(tmp_path: Path) -> None:
    """TensorBoard's writer thread fails on a full disk and re-raises the raw OSError at a later add_scalar (what a
    run on a full run dir met in CI); the log names the directory and field and drops the writer."""
    import errno

    from megatron_sao.files import DiskFull
    from megatron_sao.run.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "time": 0.0, "reward/mean": 0.5})

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    log.tb.add_scalar = full  # type: ignore[union-attr]
    with pytest.raises(DiskFull, match=f"no space left on {tmp_path} \\(launch.run_dir\\) writing tensorboard"):
        log.write({"step": 2, "time": 0.0, "reward/mean": 0.6})
    assert log.tb is None
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_docs_show_the_schemas_the_code_has() -> None:
    docs = (REPO / "docs" / "run.md").read_text()
    for record in RECORDS:
        assert schema_table(record) in docs, f"paste files.metrics_schema.schema_table({record!r}) into docs/run.md"


def test_a_resumed_run_records_every_step_once_in_metrics_and_tensorboard(tmp_path: Path) -> None:
    """A run that trained steps 1-6 and checkpointed at 4 resumes at 4 and trains 5-8: metrics.jsonl and TensorBoard
    then hold steps 1-8 once each, the resumed run's values for 5 and 6 (twice: two resumes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_sao.run.metrics import MetricsLog

    def train(first: int, last: int, resumed_at: int | None, run: int) -> None:
        log = MetricsLog(tmp_path, tensorboard=True, resumed_at=resumed_at)
        for step in range(first, last + 1):
            log.write({"step": step, "time": 1000.0 + step, "reward/mean": run * 10 + step})
        log.close()

    train(1, 6, None, 0)
    train(5, 7, 4, 1)
    train(7, 8, 6, 2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["reward/mean"] for r in records] == [1, 2, 3, 4, 15, 16, 27, 28]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == list(range(1, 9))
    assert [e.value for e in events] == [1, 2, 3, 4, 15, 16, 27, 28]


def test_plots_smooth_each_curve_and_label_both_axes(tmp_path: Path) -> None:
    """The figures (run/plot.py): each curve's raw points faint under its rolling mean, the y axis named, and
    throughput also per wall second, against wall-clock minutes."""
    from megatron_sao.run.plot import figure, plot_runs, read_steps, rolling_mean, smoothing_window

    assert rolling_mean([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5] and smoothing_window(5) == 1
    records = [{"step": i, "time": 1000.0 + 2 * i, "time/step": 2.0, "step/trajectories": 4, "step/tokens": 100.0,
                "reward/mean": float(i % 3), "throughput/tokens_per_s": 50.0} for i in range(1, 41)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = [("run", read_steps(tmp_path))]
    fig = figure("reward", runs, [[]])
    (ax,) = fig.axes
    assert ax.get_xlabel() == "learner step" and ax.get_ylabel() == "reward"
    raw, smooth = ax.get_lines()
    assert raw.get_alpha() == 0.3 and smooth.get_label() == "run (mean of 4)"
    assert list(smooth.get_ydata()) == rolling_mean([float(i % 3) for i in range(1, 41)], 4)
    wall = figure("throughput_wall", runs, [[]]).axes[0]
    assert wall.get_xlabel() == "wall-clock minutes" and wall.get_ylabel() == "tokens / s"
    xs, ys = wall.get_lines()[0].get_data()
    assert xs[0] == 2 / 60 and all(abs(y - 50.0) < 1e-9 for y in ys)  # 100 tokens every 2 s
    assert {p.stem for p in plot_runs([tmp_path], tmp_path / "plots")} >= {"reward", "throughput", "throughput_wall"}


def test_the_summary_counts_step_time_and_keeps_its_windows_apart(tmp_path: Path) -> None:
    """A 12-step run resumed after an hour: its seconds are the steps' own (not the hour), and the before/after
    reward windows (6 steps each on a short run) do not overlap."""
    from megatron_sao.run.summary import describe, summarize

    records = [{"step": i, "time": 1000.0 + 2 * i + (3600 if i > 6 else 0), "time/step": 2.0, "weight_version": i,
                "step/trajectories": 4, "reward/mean": 0.0 if i <= 6 else 1.0, "tokens/generated": 10.0}
               for i in range(1, 13)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summarize(tmp_path)
    assert s["seconds"] == 24.0 and s["tokens_per_s"] == 120 / 24
    assert s["window"] == 6 and s["reward_before"] == 0.0 and s["reward_after"] == 1.0
    assert "(last 6 steps)" in describe(s) and "over 24s of steps" in describe(s)


def test_log_lines_and_warnings_go_above_the_live_view_and_back_after() -> None:
    import logging
    import sys
    import warnings

    from rich.logging import RichHandler

    root = logging.getLogger()
    mine = logging.StreamHandler(sys.stderr)
    root.addHandler(mine)
    try:
        live = StepDisplay(max_steps=5, start=0, mode="rich")
        handlers = [h for h in root.handlers if isinstance(h, RichHandler)]
        assert len(handlers) == 1 and handlers[0].console is live.progress.console and mine not in root.handlers
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with pytest.MonkeyPatch.context() as mp:
                seen: list[logging.LogRecord] = []
                mp.setattr(handlers[0], "emit", seen.append)
                warnings.warn("old API", FutureWarning, stacklevel=1)
                logging.getLogger("megatron_sao.test").warning("a log line")
        assert [r.getMessage() for r in seen][-1] == "a log line" and any("old API" in r.getMessage() for r in seen)
        live.close()
        assert mine in root.handlers and not any(isinstance(h, RichHandler) for h in root.handlers)
    finally:
        root.removeHandler(mine)


def test_unlisted_keys_names_what_a_record_writes_beyond_its_schema() -> None:
    from megatron_sao.files.metrics_schema import unlisted_keys

    written = {"time", "worker", "rollout/trajectories", "engine/http://a:1/tokens", "rollout/bogus", "reward/mean"}
    assert unlisted_keys(written, "rollout") == ["reward/mean", "rollout/bogus"]  # a learner key is not a worker's
    assert unlisted_keys({"reward/mean", "dis/masked_low"}) == []
