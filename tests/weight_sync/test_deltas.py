"""Weight deltas end to end (weight_sync.delta, distributed/delta.py): a learner pushes only what changed into
embedded engines, which rebuild each bucket from their base. After 20 pushes at random steps (changes of random
density, real policy steps among them) an engine holds exactly what a full push of the same version gives another
engine, bf16 and block-FP8 alike; an engine that missed a version or restarted gets a full push, never a delta
against a base it lacks; a base that differs from the sender's is caught by the digest and the next push goes
whole; a delta push cut mid-way leaves the old weights and version."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import RankFailure, spawn_ranks
from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines.client import SGLangClient
from tests.engines.conftest import EngineProc
from tests.learner.test_learner_step import on_policy
from tests.weight_sync.test_weight_sync import GREEDY, PROMPT, _learner

DENSITIES = (1e-4, 2e-3, 0.03, 0.5)
"""Shares of learner elements a random change moves: sparse, bitmap and whole buckets all occur."""


def _change(model: Any, rng: random.Random) -> None:
    """Move a random share of every weight by a few percent of its scale (what a policy step at some lr does)."""
    density = rng.choice(DENSITIES)
    with torch.no_grad():
        for p in model.parameters():
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            mask = torch.rand(p.shape, generator=g) < density
            p.add_(mask * torch.randn(p.shape, generator=g) * 0.05 * (p.abs().mean() + 1e-3))


def _syncs(learner: Any, cfg: Any, url: str, fp8_dir: str | None, **changes: Any) -> Any:
    from megatron_sao.models.fp8 import checkpoint_format
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    fmt = checkpoint_format(fp8_dir) if fp8_dir else None
    sync_cfg = cfg.weight_sync.model_copy(update=changes)
    return WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.float32), sync_cfg,
                      [url], layout=learner.layout, fp8_format=fmt)  # fmt: skip


def _twenty_pushes(hf_dir: str, delta_url: str, full_url: str, fp8_dir: str | None, port: int, seed: int
                   ) -> dict[str, Any]:  # fmt: skip
    """21 pushes to the delta engine (the first whole), the weights changed at random before each (a random number
    of changes or a policy step); at three random versions the same weights pushed whole to the other engine and both
    engines' checksums taken."""
    from megatron_sao.learner.synthetic import make_batch

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, verify="checksum")
    deltas = _syncs(learner, cfg, delta_url, fp8_dir, delta="delta")
    full = _syncs(learner, cfg, full_url, fp8_dir, delta="full", master_port=port + 40, group_name="reference")
    full.pushes = 1000  # two pushers in one learner: their groups and push orders must have other names
    rng = random.Random(seed)
    compare_at = set(rng.sample(range(2, 22), 3))
    pushes, compared = [], []
    for version in range(1, 22):
        if rng.random() < 0.15:
            learner.train_step(on_policy(make_batch(4, seed=version), hf_dir))
        for _ in range(rng.randint(1, 3)):
            _change(learner.policy.model, rng)
        pushes.append(deltas.push(version))
        if version in compare_at:
            reference = full.push(version)
            a, b = SGLangClient(delta_url), SGLangClient(full_url)
            same = a.weights_checksum()["ranks"] == b.weights_checksum()["ranks"]
            versions = [a.weight_version(), b.weight_version()]
            compared.append({"version": version, "reference": reference, "versions": versions, "same": same})
    deltas.close()
    full.close()
    return {"pushes": pushes, "compared": compared}


@pytest.mark.multiproc
@pytest.mark.slow  # the tier's budget; default-tier cover: the missed/restarted test, whose delta pushes are each
@pytest.mark.parametrize("engine_dtype", ["bf16", "fp8"])  # verified by checksum against what a full push sends
def test_twenty_delta_pushes_leave_an_engine_bit_identical_to_a_full_push(
    start_engine: Any, tmp_path: Path, engine_dtype: str
) -> None:
    from megatron_sao.models.fp8 import write_checkpoint
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = make_tiny_model("qwen3_moe", tmp_path / "hf", seed=1, dtype="bf16" if engine_dtype == "bf16" else "fp32")
    fp8_dir = None
    if engine_dtype == "fp8":
        fp8_dir = tmp_path / "fp8"
        write_checkpoint(hf_dir, fp8_dir, block=(16, 16))
    engines = [start_engine(fp8_dir or hf_dir) for _ in range(2)]
    for e in engines:
        e.wait_healthy()
    (out,) = spawn_ranks(_twenty_pushes, 1, str(hf_dir), engines[0].url, engines[1].url,
                         None if fp8_dir is None else str(fp8_dir), find_free_port(), 5, timeout_s=600)  # fmt: skip
    pushes = out["pushes"]
    assert all(p["sync/failed"] == 0 and p["sync/unverified"] == 0 for p in pushes), pushes
    # every push is verified by the push's own checksums: each tensor the engine holds == the full push's bytes
    assert pushes[0]["sync/delta_buckets"] == 0 and pushes[0]["sync/bytes"] == pushes[0]["sync/bytes_full"]
    later = pushes[1:]
    assert sum(p["sync/delta_buckets"] > 0 for p in later) >= 15, [p["sync/delta_buckets"] for p in later]
    sparse = min(p["sync/bytes"] / p["sync/bytes_full"] for p in later)
    assert sparse < 0.1, f"the sparsest push still sent {sparse:.2f} of the full bytes"
    assert pushes[-1]["sync/delta_base_mb"] > 0
    for c in out["compared"]:
        assert c["reference"]["sync/failed"] == 0
        assert c["versions"] == [c["version"]] * 2
        assert c["same"], f"version {c['version']}: the delta engine's weights differ from a full push's"


def _missed_restarted_corrupted(hf_dir: str, urls: list[str], port: int, pids: list[int], restart_log: str
                                ) -> dict[str, Any]:  # fmt: skip
    """Two engines, deltas on. v1 whole, v2 delta to both; engine B stopped (SIGSTOP): v3 a delta to A alone; B back:
    v4 whole to both (B holds base 2), v5 delta; engine A killed and started again on its port: v6 whole, v7 delta;
    a delta that does not rebuild the new bytes (a base that differs): v8 refused by the digest, v9 whole."""
    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, delta="delta", verify="checksum")
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    sync = WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.float32),
                      cfg.weight_sync, urls, layout=learner.layout)  # fmt: skip
    rng = random.Random(0)
    out: dict[str, Any] = {}

    def push(version: int) -> dict[str, float]:
        with torch.no_grad():  # a sparse change: every bucket can go as a delta
            for p in learner.policy.model.parameters():
                flat = p.view(-1)
                flat[rng.randrange(flat.numel())] += 0.5
        return sync.push(version)

    out["v1"], out["v2"] = push(1), push(2)
    os.kill(pids[1], signal.SIGSTOP)
    out["v3"] = push(3)
    os.kill(pids[1], signal.SIGCONT)
    out["v4"], out["v5"] = push(4), push(5)
    port_a = int(urls[0].rsplit(":", 1)[1])
    restarted = _restart(hf_dir, port_a, Path(restart_log), pids[0])
    out["v6"], out["v7"] = push(6), push(7)
    from megatron_sao.distributed.delta import POSITION_BYTES, Encoded
    from megatron_sao.weight_sync.sender import Bases

    real_encode = Bases.encode

    def short(self: Any, *a: Any) -> Encoded:  # one change left out: the delta no longer takes the base to the new
        enc = real_encode(self, *a)  # bytes, as when the engine's base is not the source's
        if enc.encoding != "sparse" or enc.count == 0:
            return enc
        n, u = enc.count, enc.unit
        kept = torch.cat([enc.payload[: (n - 1) * POSITION_BYTES], enc.payload[n * POSITION_BYTES : -u]])
        return Encoded("sparse", n - 1, u, kept)

    Bases.encode = short  # type: ignore[method-assign]
    before = [SGLangClient(u).weights_checksum()["ranks"] for u in urls]
    out["v8"] = push(8)
    Bases.encode = real_encode  # type: ignore[method-assign]
    out["kept"] = [SGLangClient(u).weights_checksum()["ranks"] for u in urls] == before
    out["versions8"] = [SGLangClient(u).weight_version() for u in urls]
    out["v9"] = push(9)
    out["same"] = len({str(SGLangClient(u).weights_checksum()["ranks"]) for u in urls}) == 1
    out["versions"] = [SGLangClient(u).weight_version() for u in urls]
    sync.close()
    restarted.kill()
    return out


def _restart(hf_dir: str, port: int, log: Path, pid: int) -> EngineProc:
    """Kill the engine on `port` and start a new one there (a restart: launch weights, no bases)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while SGLangClient(f"http://127.0.0.1:{port}").health(timeout_s=0.5) and time.monotonic() < deadline:
        time.sleep(0.2)
    engine = EngineProc(Path(hf_dir), log, port=port)
    engine.wait_healthy()
    return engine


@pytest.mark.multiproc
def test_an_engine_that_missed_a_version_or_restarted_gets_a_full_push_and_a_bad_base_is_caught(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Path
) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    engines = [start_engine(hf_dir) for _ in range(2)]
    for e in engines:
        e.wait_healthy()
    try:
        (out,) = spawn_ranks(_missed_restarted_corrupted, 1, str(hf_dir), [e.url for e in engines], find_free_port(),
                             [e.proc.pid for e in engines], str(tmp_path / "restarted.log"), timeout_s=600)  # fmt: skip
    finally:
        os.kill(engines[1].proc.pid, signal.SIGCONT)
    ok = lambda m: m["sync/failed"] == 0 and m["sync/unverified"] == 0  # noqa: E731
    delta = lambda m: m["sync/delta_buckets"] > 0  # noqa: E731
    assert ok(out["v1"]) and not delta(out["v1"])
    assert ok(out["v2"]) and delta(out["v2"]) and out["v2"]["sync/engines"] == 2
    assert ok(out["v3"]) and delta(out["v3"]) and out["v3"]["sync/engines"] == 1, out["v3"]  # B stopped: left out
    assert ok(out["v4"]) and not delta(out["v4"]) and out["v4"]["sync/engines"] == 2, out["v4"]  # B missed v3
    assert ok(out["v5"]) and delta(out["v5"])
    assert ok(out["v6"]) and not delta(out["v6"]) and out["v6"]["sync/engines"] == 2, out["v6"]  # A restarted
    assert ok(out["v7"]) and delta(out["v7"])
    assert out["v8"]["sync/failed"] == 1 and out["kept"] and out["versions8"] == [7, 7], out["v8"]
    assert ok(out["v9"]) and not delta(out["v9"])
    assert out["same"] and out["versions"] == [9, 9]


def _cut_delta(hf_dir: str, url: str, port: int) -> None:
    """v1 whole, then a sparse change sent as a delta, the trainer dying mid-way through its buckets."""
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of
    from megatron_sao.weight_sync import sender as sender_mod

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, delta="delta")
    sync = WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.float32),
                      cfg.weight_sync, [url], layout=learner.layout)  # fmt: skip
    assert sync.push(1)["sync/failed"] == 0
    target = len(sync.plan.stages[0].buckets) // 2
    real_start = sender_mod.StageSender.start

    def start(self: Any, bucket: Any, buffer: torch.Tensor) -> Any:
        sent = real_start(self, bucket, buffer)
        if bucket.index == target:
            assert self.stats["delta_buckets"] > 0, "the cut push must travel as deltas"
            time.sleep(0.05)
            os._exit(17)
        return sent

    sender_mod.StageSender.start = start  # type: ignore[method-assign]
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.view(-1)[0] += 0.5
    sync.push(2)


@pytest.mark.multiproc
@pytest.mark.slow  # default-tier cover: a refused delta push (the missed/restarted test's v8: its session fails and
# the bases it wrote into are dropped) and the full/sharded push cut mid-bucket (test_weight_sync.py)
def test_a_delta_push_cut_mid_way_leaves_the_old_weights_and_version(start_engine: Any, tiny_hf_dir: Any) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    engine = start_engine(hf_dir, "--weight-session-timeout", "5")
    engine.wait_healthy()
    client = SGLangClient(engine.url)
    with pytest.raises(RankFailure, match="exited with code 17"):
        spawn_ranks(_cut_delta, 1, str(hf_dir), engine.url, find_free_port(), timeout_s=400)
    assert client.weight_version() == 1
    held = client.weights_checksum()["ranks"]
    out = client.generate(PROMPT, {"max_new_tokens": 4, **GREEDY}, timeout_s=60)
    assert out.versions == [1] * 4
    time.sleep(1.0)
    assert client.weights_checksum()["ranks"] == held, "a cut delta push changed the engine's weights"
    # the buckets that arrived were written into the bases, which then held neither version: they are dropped, so
    # the next trainer's push comes whole
    assert client.server_info()["weight_delta_base"] is None


def _through_agent(hf_dir: str, agent_url: str, full_url: str, port: int) -> dict[str, Any]:
    """Three pushes through a push agent with deltas (the first whole), each also pushed whole to a reference engine;
    a sparse change before each."""
    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.05, verify="none")
    via = _syncs(learner, cfg, agent_url, None, delta="delta")
    full = _syncs(learner, cfg, full_url, None, delta="full", master_port=port + 40, group_name="reference")
    full.pushes = 1000  # two pushers in one learner: their groups and push orders must have other names
    out: dict[str, Any] = {"pushes": [], "agent_bytes": []}
    agent = SGLangClient(agent_url)
    for version in (1, 2, 3):
        with torch.no_grad():
            for i, p in enumerate(learner.policy.model.parameters()):
                p.view(-1)[(version * 7 + i) % p.numel()] += 0.25
        out["pushes"].append(via.push(version))
        assert full.push(version)["sync/failed"] == 0
        ranks = agent.server_info()["tp_ranks"]
        out["agent_bytes"].append([sum(g["bytes"] for g in r["weight_update_groups"].values()) for r in ranks])
    via.close()
    full.close()
    return out


@pytest.mark.multiproc
@pytest.mark.slow  # the tier's budget; default-tier cover: the agent's receiver is the embedded engine's (its
# deltas tested in the default tier) and a run pushes through an agent end to end (tests/run/test_local_run.py)
def test_a_push_agent_rebuilds_deltas_on_its_host_copy_and_hands_over_full_slices(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Path
) -> None:
    """The agent of a TP=2 engine receives each rank's blocks as deltas against its host copy, rebuilds them and hands
    the engine its full slices (load_format direct): rank by rank the engine holds what an engine given full pushes
    holds, and generates the same greedy tokens; the second and third pushes carry a small share of the first's."""
    from tests.weight_sync.test_agent import AgentProc

    hf_dir = tiny_hf_dir("qwen3_moe")
    reference, engine = (start_engine(hf_dir, "--tp-size", "2") for _ in range(2))
    for e in (reference, engine):
        e.wait_healthy()
    agent = AgentProc(engine.url, tmp_path / "agent.log", "--handover", "direct")
    try:
        agent.wait_healthy()
        (out,) = spawn_ranks(_through_agent, 1, str(hf_dir), agent.url, reference.url, find_free_port(),
                             timeout_s=600)  # fmt: skip
    finally:
        agent.kill()
    first, *later = out["pushes"]
    assert all(p["sync/failed"] == 0 for p in out["pushes"]), out["pushes"]
    assert first["sync/delta_buckets"] == 0 and all(p["sync/delta_buckets"] > 0 for p in later)
    totals = [[0, 0], *out["agent_bytes"]]  # what each agent rank received so far, after each push
    sent = [[y - x for x, y in zip(a, b)] for a, b in zip(totals, totals[1:])]  # per push, per agent rank
    assert all(max(s) < 0.1 * min(sent[0]) for s in sent[1:]), sent
    got, want = SGLangClient(engine.url), SGLangClient(reference.url)
    assert [r["checksums"] for r in got.weights_checksum()["ranks"]] == \
        [r["checksums"] for r in want.weights_checksum()["ranks"]]  # fmt: skip
    tokens = want.generate(PROMPT, {"max_new_tokens": 8, **GREEDY}).output_ids
    gen = got.generate(PROMPT, {"max_new_tokens": 8, **GREEDY})
    assert gen.output_ids == tokens and gen.versions == [3] * 8


@pytest.mark.multiproc
@pytest.mark.slow  # the same sharded deltas an agent's TP=2 ranks take (the test above, slow too)
def test_a_tp2_engine_takes_sharded_deltas_rank_by_rank(start_engine: Any, tiny_hf_dir: Any) -> None:
    """An embedded TP=2 engine without an agent: each rank receives its block part as a delta over its block group
    (every rank's base is its own blocks) and commits; rank by rank it then holds what a TP=2 engine given full pushes
    holds."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    reference, engine = (start_engine(hf_dir, "--tp-size", "2") for _ in range(2))
    for e in (reference, engine):
        e.wait_healthy()
    (out,) = spawn_ranks(_through_agent, 1, str(hf_dir), engine.url, reference.url, find_free_port(), timeout_s=600)
    first, *later = out["pushes"]
    assert all(p["sync/failed"] == 0 and p["sync/sharded"] == 1 for p in out["pushes"]), out["pushes"]
    assert first["sync/delta_buckets"] == 0 and all(p["sync/delta_buckets"] > 0 for p in later)
    got, want = SGLangClient(engine.url), SGLangClient(reference.url)
    assert [r["checksums"] for r in got.weights_checksum()["ranks"]] == \
        [r["checksums"] for r in want.weights_checksum()["ranks"]]  # fmt: skip
    assert got.weight_version() == 3
