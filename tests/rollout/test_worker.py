"""The rollout worker: one trajectory per (prompt, sample) pushed at once, re-issue on engine failure, exactly once."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.engines.client import EngineError, EngineRouter, NoHealthyEngine, RetryPolicy, SGLangClient
from megatron_sao.engines.protocol import GenerateResult
from megatron_sao.models.tiny import build_tiny_tokenizer
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, ChatTemplateCodec
from megatron_sao.rollout.envs import make_env
from megatron_sao.rollout.prompts import PromptCursor
from megatron_sao.rollout.worker import InMemorySink, RolloutWorker, WorkerConfig

TOK = build_tiny_tokenizer()


class FlakyEngine:
    """Answers "<answer>N</answer>"; fails the first call of every prompt listed in `fail_once`."""

    def __init__(self, fail_once: set[str] = frozenset()) -> None:
        self.fail_once = set(fail_once)
        self.lock = threading.Lock()
        self.calls = 0

    def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
        text = TOK.decode(input_ids)
        with self.lock:
            self.calls += 1
            hit = next((p for p in self.fail_once if p in text), None)
            if hit:
                self.fail_once.discard(hit)
                raise NoHealthyEngine("scripted outage")
        ids = TOK("<answer>1</answer>", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        return GenerateResult("r", ids, [-0.5] * len(ids), [0] * len(ids), "stop", {"type": "stop"}, 0, 1), "fake"


def make_worker(engine: Any, n: int, tmp_path: Path, **cfg: Any) -> tuple[RolloutWorker, InMemorySink]:
    records = [{"id": f"q{i}", "question": f"question number {i}?", "answer": "1"} for i in range(n)]
    loop = AgentLoop(make_env("verifiable_answer"), ChatTemplateCodec(TOK), engine, AgentLoopConfig())
    sink = InMemorySink()
    wcfg = WorkerConfig(concurrency=4, log_interval_s=0.2, retry_backoff_s=0.01, state_path=str(tmp_path / "c.json"),
                        ledger_path=str(tmp_path / "ledger.jsonl"))  # fmt: skip
    for k, v in cfg.items():
        setattr(wcfg, k, v)
    return RolloutWorker(PromptCursor(records), loop, sink, wcfg), sink


def test_every_prompt_yields_one_trajectory_and_the_cursor_records_it(tmp_path: Path) -> None:
    worker, sink = make_worker(FlakyEngine(), 10, tmp_path)
    status = worker.run()
    assert sorted(t.header.prompt_id for t in sink.items) == sorted(f"q{i}" for i in range(10))
    assert {t.header.sample_index for t in sink.items} == {0} and status["trajectories"] == 10
    assert status["mean_reward"] == 1.0
    assert worker.cursor.state_dict()["completed"] == 10 and not worker.cursor.state_dict()["pending"]


def test_grpo_arm_gets_g_samples_per_prompt(tmp_path: Path) -> None:
    worker, sink = make_worker(FlakyEngine(), 3, tmp_path, rollouts_per_prompt=4)
    worker.run()
    groups: dict[str, list[int]] = {}
    for t in sink.items:
        groups.setdefault(t.header.prompt_id, []).append(t.header.sample_index)
    assert {k: sorted(v) for k, v in groups.items()} == {f"q{i}": [0, 1, 2, 3] for i in range(3)}
    assert len({t.trajectory_id for t in sink.items}) == 12


def test_failed_episodes_are_reissued_and_pushed_once(tmp_path: Path) -> None:
    engine = FlakyEngine(fail_once={"number 2?", "number 5?"})
    worker, sink = make_worker(engine, 8, tmp_path)
    status = worker.run()
    assert sorted(t.header.prompt_id for t in sink.items) == sorted(f"q{i}" for i in range(8))
    assert status["reissued"] == 2 and status["failed"] == 0


def test_episodes_failing_every_attempt_are_counted_not_pushed(tmp_path: Path) -> None:
    from megatron_sao.engines import client as C

    class Failing(FlakyEngine):
        def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
            raise C.EngineError.of("fake", 500, {"error": {"message": "RuntimeError: CUDA error"}})

    worker, sink = make_worker(Failing(), 3, tmp_path, max_attempts=2)
    status = worker.run()
    assert sink.items == [] and status["failed"] == 3 and status["reissued"] == 3


def test_with_every_engine_down_episodes_wait_and_no_prompt_is_burnt(tmp_path: Path) -> None:
    """The only engine restarting: episodes wait for it (no attempt used up, nothing failed) and the worker takes no
    more prompts than its concurrency meanwhile."""

    class Restarting(FlakyEngine):
        def __init__(self) -> None:
            super().__init__()
            self.back_at, self.down_calls = time.monotonic() + 1.5, 0

        def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
            if time.monotonic() < self.back_at:
                with self.lock:
                    self.down_calls += 1
                raise NoHealthyEngine("no healthy engine left (down: ['http://e:1'])")
            return super().__call__(input_ids, sampling)

    engine = Restarting()
    worker, sink = make_worker(engine, 200, tmp_path, max_attempts=2, retry_backoff_s=0.1)
    status = worker.run(max_prompts=12)
    assert status["failed"] == 0
    assert sorted(t.header.prompt_id for t in sink.items) == sorted(f"q{i}" for i in range(12))
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert not [x for x in ledger if x["event"] == "failed"]
    assert engine.down_calls <= 4 * (1.5 / 0.1 + 3)  # 4 episodes (the concurrency) asking about every 0.1 s


def test_a_restarted_worker_continues_where_the_cursor_stopped(tmp_path: Path) -> None:
    worker, sink = make_worker(FlakyEngine(), 10, tmp_path)
    worker.run(max_prompts=4)
    twin, _ = make_worker(FlakyEngine(), 10, tmp_path)  # same state_path while the first still holds it
    with pytest.raises(ValueError, match=rf"rollout-0.*held by a live worker \(pid {os.getpid()}\).*--worker-id"):
        twin.run()
    worker.close()
    again, sink2 = make_worker(FlakyEngine(), 10, tmp_path)
    again.run()
    first, second = {t.header.prompt_id for t in sink.items}, {t.header.prompt_id for t in sink2.items}
    assert len(first) == 4 and first.isdisjoint(second) and first | second == {f"q{i}" for i in range(10)}


class VolatileSink(InMemorySink):
    """A bus without a spool: what was sent can be lost until the learner commits it."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: set[str] = set()

    def volatile_ids(self) -> set[str]:
        return {t.trajectory_id for t in self.items} - self.committed


def test_prompts_whose_trajectories_are_not_durable_stay_pending_in_the_saved_cursor(tmp_path: Path) -> None:
    worker, _ = make_worker(FlakyEngine(), 6, tmp_path)
    sink = worker.sink = VolatileSink()
    worker.run(max_prompts=6)
    saved = json.loads((tmp_path / "c.json").read_text())  # nothing committed: a crash now must re-issue all six
    assert sorted(saved["pending"]) == [f"0:{i}" for i in range(6)] and saved["completed"] == 0
    sink.committed = {t.trajectory_id for t in sink.items[:4]}
    worker.close()
    saved = json.loads((tmp_path / "c.json").read_text())
    keys = {t.trajectory_id: k for k, t in zip(_keys_by_order(tmp_path), sink.items, strict=True)}
    assert sorted(saved["pending"]) == sorted(keys[t.trajectory_id] for t in sink.items[4:]) and saved["completed"] == 4
    again, sink2 = make_worker(FlakyEngine(), 6, tmp_path)
    again.run(max_prompts=2)  # the two re-issued first
    assert sorted(t.header.prompt_id for t in sink2.items) == sorted(t.header.prompt_id for t in sink.items[4:])


def test_a_trajectory_lost_from_a_damaged_spool_has_its_prompt_generated_again(tmp_path: Path) -> None:
    from megatron_sao.run.ledger import check_ledger

    class LossySink(InMemorySink):
        """The bus of a restarted worker whose spool had q3's trajectory torn."""

        def rejected(self) -> list[tuple[str, str, str]]:
            lost = [t for t in self.items if t.header.prompt_id == "q3"][:1]
            return [(t.trajectory_id, "spool_corrupt", "size 100 != 200") for t in lost]

    worker, _ = make_worker(FlakyEngine(), 6, tmp_path, concurrency=1)
    sink = worker.sink = LossySink()
    worker.run()
    worker.close()
    assert sorted(t.header.prompt_id for t in sink.items) == ["q0", "q1", "q2", "q3", "q3", "q4", "q5"]
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    (rejected,) = [x for x in ledger if x["event"] == "rejected"]
    assert rejected["reason"] == "spool_corrupt" and rejected["reopened"] == "0:3"
    assert json.loads((tmp_path / "c.json").read_text())["completed"] == 6  # q3 done again, by its second sample
    run = tmp_path / "run"  # the checker: the lost one is accounted for by the prompt's second trajectory
    (run / "ledger").mkdir(parents=True)
    (run / "ledger" / "rollout-0.jsonl").write_text((tmp_path / "ledger.jsonl").read_text())
    trained = [{"id": t.trajectory_id, "step_version": 1, "worker": "rollout-0"} for t in sink.items]
    (run / "trajectories.jsonl").write_text("".join(json.dumps(x) + "\n" for x in trained if x["id"] != rejected["id"]))
    report = check_ledger(run)
    assert report.ok and (report.spool_lost, report.regenerated) == (1, 1), report.describe()


def _keys_by_order(tmp_path: Path) -> list[str]:
    """The prompt key of each trajectory, in the order the worker sent them (its ledger's `sending` lines)."""
    return [x["prompt"] for x in map(json.loads, (tmp_path / "ledger.jsonl").read_text().splitlines())
            if x["event"] == "sending"]  # fmt: skip


def test_a_failing_episode_is_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    from megatron_sao.engines import client as C

    failed_500: list[str] = []

    class Broken(FlakyEngine):
        def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
            text = TOK.decode(input_ids)
            if "number 2?" in text:
                raise KeyError("an agent-loop / environment bug")
            if "number 5?" in text:
                raise EngineError("fake", 400, {"error": {"message": "ValueError: bad prompt"}})
            if "number 7?" in text and not failed_500:
                failed_500.append(text)
                raise C.EngineError.of("fake", 500, {"error": {"message": "RuntimeError: oops"}})
            time.sleep(0.01)
            return super().__call__(input_ids, sampling)

    worker, sink = make_worker(Broken(), 10, tmp_path)
    status = worker.run()
    assert sorted(t.header.prompt_id for t in sink.items) == sorted(f"q{i}" for i in range(10) if i not in (2, 5))
    assert status["failed"] == 2  # not retried: sending them again cannot help
    assert status["reissued"] == 1  # the engine's 5xx: the episode is started again
    assert worker.cursor.state_dict()["completed"] == 10 and not worker.cursor.state_dict()["pending"]


def test_a_backoff_does_not_hold_back_finished_episodes(tmp_path: Path) -> None:
    sent_at: dict[str, float] = {}

    class Slow(FlakyEngine):
        def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
            if "number 1?" in TOK.decode(input_ids):
                time.sleep(0.2)
            return super().__call__(input_ids, sampling)

    class Clock(InMemorySink):
        def send(self, traj: Any) -> None:
            sent_at[traj.header.prompt_id] = time.monotonic() - t0
            super().send(traj)

    worker, _ = make_worker(Slow(fail_once={"number 0?"}), 2, tmp_path, concurrency=2, retry_backoff_s=2.0)
    worker.sink = Clock()
    t0 = time.monotonic()
    status = worker.run()
    assert status["reissued"] == 1 and status["trajectories"] == 2
    assert sent_at["q1"] < 1.0  # sent when it finished, not after q0's back-off
    assert sent_at["q0"] >= 2.0  # the back-off itself is kept


def test_a_crashed_worker_repeats_no_completed_prompt(tmp_path: Path) -> None:
    class Crash(Exception):
        pass

    class Crashing(InMemorySink):
        def send(self, traj: Any) -> None:
            if len(self.items) == 4:
                raise Crash("the process dies here")
            super().send(traj)

    worker, _ = make_worker(FlakyEngine(), 10, tmp_path, concurrency=1, log_interval_s=3600.0)
    worker.sink = first = Crashing()
    with pytest.raises(Crash):
        worker.run()  # no status line and no final save: only what was saved along the way survives
    again, second = make_worker(FlakyEngine(), 10, tmp_path)
    again.run()
    done, redone = {t.header.prompt_id for t in first.items}, {t.header.prompt_id for t in second.items}
    assert done == {f"q{i}" for i in range(4)} and redone == {f"q{i}" for i in range(4, 10)}


@pytest.mark.multiproc
def test_engine_killed_mid_request_the_prompt_is_reissued_and_pushed_once(
    start_engine: Any, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    engines = [start_engine(tiny_dirs["qwen3_moe"]) for _ in range(2)]
    for e in engines:
        e.wait_healthy()
    victim = engines[0]
    router = EngineRouter([SGLangClient(e.url, retry=RetryPolicy(2, 0.05), timeout_s=60) for e in engines])
    n = 12
    records = [{"id": f"k{i}", "question": f"q {i}?", "answer": "1"} for i in range(n)]
    sampling = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}
    loop = AgentLoop(
        make_env("verifiable_answer"), ChatTemplateCodec(TOK), router.generate, AgentLoopConfig(sampling=sampling)
    )
    sink = InMemorySink()
    worker = RolloutWorker(PromptCursor(records), loop, sink, WorkerConfig(concurrency=6, log_interval_s=0.5), router)

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 60
        while router.stats()[victim.url]["outstanding"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        victim.proc.send_signal(9)  # SIGKILL with requests in flight

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    status = worker.run()
    killer.join()
    ids = [t.header.prompt_id for t in sink.items]
    assert sorted(ids) == sorted(r["id"] for r in records)  # every prompt once: none lost, none pushed twice
    assert len({t.trajectory_id for t in sink.items}) == n
    assert status["engines"][victim.url]["failures"] >= 1 and not status["engines"][victim.url]["healthy"]
    assert router.stats()[engines[1].url]["requests"] > n // 2  # the survivor took over the re-issued work
    assert victim.proc.poll() is not None


def test_worker_from_config_rolls_out_on_an_engine(engine_url: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.rollout.worker import worker_from_config

    cfg = load_config(None, ["--model.hf_path", str(tiny_dirs["qwen3_moe"]), "--rollout.env.name", "verifiable_answer",
                             "--rollout.sampling.max_new_tokens", "8", "--algo.name", "grpo",
                             "--algo.grpo.group_size", "2", "--launch.run_dir", str(tmp_path)])  # fmt: skip
    sink = InMemorySink()
    worker = worker_from_config(cfg, sink, [engine_url])
    status = worker.run(max_prompts=3)
    assert status["trajectories"] == 6 and (tmp_path / "rollout_cursor.json").is_file()
    assert all(t.num_action_tokens <= 8 and t.header.engine_id == engine_url for t in sink.items)


class VersionedEngine:
    """Answers "<answer>1</answer>" with tokens tagged by the current `version` (set by a fake learner); prompts in
    `always_fail` fail every attempt."""

    def __init__(self, always_fail: set[str] = frozenset()) -> None:
        self.version, self.always_fail = 0, set(always_fail)

    def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
        if any(p in TOK.decode(input_ids) for p in self.always_fail):  # the engine fails handling it (HTTP 500)
            raise EngineError.of("fake", 500, {"error": {"message": "RuntimeError: scripted failure"}})
        ids = TOK("<answer>1</answer>", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        v = self.version
        time.sleep(0.002)
        return GenerateResult("r", ids, [-0.5] * len(ids), [v] * len(ids), "stop", {"type": "stop"}, v, 1), "fake"


class FakeRouter:
    def __init__(self, engine: VersionedEngine) -> None:
        self.engine = engine

    def current_version(self) -> int:
        return self.engine.version

    def check_health(self) -> dict[str, bool]:
        return {"fake": True}

    def stats(self) -> dict[str, Any]:
        return {}


def _batched(tmp_path: Path, engine: VersionedEngine, lag: int, batches: int, prompts: int = 2, group: int = 2,
             n: int = 40) -> tuple[RolloutWorker, InMemorySink, threading.Thread]:  # fmt: skip
    records = [{"id": f"q{i}", "question": f"question number {i}?", "answer": "1"} for i in range(n)]
    loop = AgentLoop(make_env("verifiable_answer"), ChatTemplateCodec(TOK), engine, AgentLoopConfig())
    sink = InMemorySink()
    wcfg = WorkerConfig(concurrency=3, log_interval_s=5, retry_backoff_s=0.01, rollouts_per_prompt=group,
                        batch_prompts=prompts, batch_lag=lag, gate_poll_s=0.01, max_attempts=2)  # fmt: skip
    worker = RolloutWorker(PromptCursor(records), loop, sink, wcfg, FakeRouter(engine))  # type: ignore[arg-type]
    per_batch = prompts * group

    def learner() -> None:
        """Steps on each whole batch: grpo pushes right after the step; grpo_async pushes v_k once batch k is in."""
        for k in range(batches):
            deadline = time.monotonic() + 60
            while len(sink.items) < per_batch * (k + 1):
                assert time.monotonic() < deadline, f"batch {k} never completed"
                time.sleep(0.005)
            time.sleep(0.05)  # training
            if lag == 0:
                engine.version = k + 1
            elif k >= 1:
                engine.version = k

    thread = threading.Thread(target=learner, daemon=True)
    return worker, sink, thread


@pytest.mark.parametrize("lag", [0, 1], ids=["grpo", "grpo_async"])
def test_group_arms_generate_batches_in_lockstep_with_the_weights(tmp_path: Path, lag: int) -> None:
    engine = VersionedEngine()
    batches = 4
    worker, sink, learner = _batched(tmp_path, engine, lag, batches)
    learner.start()
    worker.run(max_prompts=2 * batches)
    learner.join(60)
    per_batch = 4
    ledger = [sorted({int(v) for t in sink.items[i:i + per_batch] for v in t.weight_versions[t.action_mask]})
              for i in range(0, len(sink.items), per_batch)]  # fmt: skip
    # grpo: batch k on the weights trained on batch k-1 (version k); grpo_async: one version older (k-1), batch 0 and 1
    # on the launch weights
    want = [[k] for k in range(batches)] if lag == 0 else [[0], [0], [1], [2]]
    assert ledger == want
    for i in range(0, len(sink.items), 2):  # every group whole and contiguous
        pair = sink.items[i : i + 2]
        assert pair[0].header.prompt_id == pair[1].header.prompt_id
        assert [t.header.sample_index for t in pair] == [0, 1]


def test_a_group_with_a_failed_sample_is_dropped_and_replaced(tmp_path: Path) -> None:
    engine = VersionedEngine(always_fail={"number 1?"})
    worker, sink, learner = _batched(tmp_path, engine, 0, 2)
    learner.start()
    status = worker.run(max_prompts=5)  # 2 batches of 2 prompts need 5 prompts: q1's group is dropped
    learner.join(60)
    assert status["dropped_groups"] == 1 and len(sink.items) == 8
    assert "q1" not in {t.header.prompt_id for t in sink.items}


class GrantingSink(InMemorySink):
    """A sink under rollout admission: `grants` starts at first, one more per trajectory it takes (as a learner
    that trains them makes room); records how many episodes ran at once under its grants."""

    admitting = True

    def __init__(self, grants: int) -> None:
        super().__init__()
        self.available, self.running, self.most, self.floors = grants, 0, 0, []

    def take_starts(self, k: int, floor: int) -> int:
        with self._lock:
            made = min(k, self.available)
            self.available -= made
            self.running += made
            self.most = max(self.most, self.running)
            self.floors += [floor] * made
            return made

    def end_start(self, floor: int) -> None:
        with self._lock:
            self.running -= 1

    def send(self, traj: Any) -> None:
        super().send(traj)
        with self._lock:
            self.available += 1


class FloorRouter:
    def __init__(self) -> None:
        self.asked = 0

    def version_floor(self) -> int:
        return 3

    def current_version(self) -> int:
        self.asked += 1
        return 3

    def stats(self) -> dict[str, Any]:
        return {}

    def check_health(self) -> dict[str, bool]:
        return {}


def test_under_admission_episodes_start_only_under_granted_starts_and_give_them_back(tmp_path: Path) -> None:
    worker, _ = make_worker(FlakyEngine(fail_once={"number 1?"}), 10, tmp_path)  # a re-issue keeps its start
    sink = worker.sink = GrantingSink(grants=2)
    worker.router = FloorRouter()  # type: ignore[assignment]
    status = worker.run()
    assert sorted(t.header.prompt_id for t in sink.items) == sorted(f"q{i}" for i in range(10))
    assert status["reissued"] == 1
    assert sink.most == 2  # concurrency 4, but two granted starts at a time
    assert sink.running == 0  # every start taken was given back (episodes ended, and the unused ones at the end)
    assert set(sink.floors) == {3}
    assert worker.router.asked >= 1  # denied, it asked the engines for their version afresh


def test_a_sink_that_waits_for_its_learner_starts_nothing(tmp_path: Path) -> None:
    worker, _ = make_worker(FlakyEngine(), 3, tmp_path)
    sink = worker.sink = GrantingSink(grants=5)
    sink.admitting = None  # configured for admission, no learner answered yet
    worker.router = FloorRouter()  # type: ignore[assignment]
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    worker.run(stop=stop)
    assert not sink.items and sink.floors == []
