"""Pushes through WeightSync into running embedded engines: from a 4-rank learner (TP=2 x PP=2, EP=2 x PP=2) into
two engines, whose log-probs then equal the learner's, each stage having sent only its own layers over its own
group; a push refused or cut at any bucket leaves the engine's weights and version exactly as before, and it keeps
generating; a generation in flight across a push carries two versions, with no flush SGLang forbids."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from megatron_sao.distributed import RankFailure, spawn_ranks
from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import SGLangClient
from tests.learner.test_learner_step import learner_config, on_policy

PROMPT = [3, 17, 29, 5, 11]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
LOGP_TOL = 1e-4  # fp32 megatron learner (CPU) vs the engine's transformers model on the same weights


def _learner(hf_dir: str, layout: dict[str, int], port: int, bucket_mb: float, **sync: Any) -> tuple[Any, Any]:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, layout, int(os.environ["WORLD_SIZE"]))
    cfg.weight_sync.master_port, cfg.weight_sync.bucket_mb = port, bucket_mb
    for key, value in sync.items():
        setattr(cfg.weight_sync, key, value)
    ctx = init_distributed(cfg.parallel, seed=3)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    return cfg, learner


def _sync(learner: Any, cfg: Any, urls: list[str]) -> Any:
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    return WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.float32),
                      cfg.weight_sync, urls, layout=learner.layout)  # fmt: skip


def _learner_logprobs(learner: Any, tokens: list[int], prompt_len: int) -> list[float] | None:
    """The learner's log-probs (temperature 1) of tokens[prompt_len:]; on the ranks that hold outputs, else None."""
    import numpy as np

    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.forward import collect_logprobs
    from megatron_sao.learner.packing import pack_microbatches
    from megatron_sao.learner.synthetic import make_trajectory

    traj = make_trajectory(np.random.default_rng(0), 0, prompt_len=prompt_len, turns=(len(tokens) - prompt_len,))
    traj.tokens[:] = np.asarray(tokens, dtype=np.int32)
    batch = make_step_batch([traj], max_seq_len=4096)
    mbs = pack_microbatches(batch, max_tokens=64, pad_multiple=learner.cfg.parallel.tensor, use_thd=False)
    logp = torch.zeros_like(batch.rollout_logprobs)
    with torch.no_grad():
        if not collect_logprobs(
            learner.policy.model,
            mbs,
            logp,
            temperature=1.0,
            vocab_size=learner.spec.vocab_size,
            tp_rank=learner.layout.tp_rank,
        ):
            return None
    return [float(x) for x in logp[0, prompt_len - 1 :]]


def _train_push_compare(hf_dir: str, layout: dict[str, int], urls: list[str], port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_sao.learner.synthetic import make_batch

    cfg, learner = _learner(hf_dir, layout, port, bucket_mb=0.05)
    sync = _sync(learner, cfg, urls)
    learner.train_step(on_policy(make_batch(6, seed=3), hf_dir))
    metrics = sync.push(learner.version)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        clients = [SGLangClient(u) for u in urls]
        outs = [c.generate(PROMPT, {"max_new_tokens": 10, **GREEDY}) for c in clients]
        info = [c.request("GET", P.SERVER_INFO) for c in clients]
        box[0] = {"outs": outs, "groups": [i["weight_update_groups"] for i in info],
                  "orders": [i["weight_update_order"] for i in info],
                  "versions": [c.weight_version() for c in clients]}  # fmt: skip
    dist.broadcast_object_list(box, src=0)
    engine = box[0]
    mine = [_learner_logprobs(learner, PROMPT + o.output_ids, len(PROMPT)) for o in engine["outs"]]
    out = {"metrics": metrics, "peak": sync.peak_bytes, "bound": sync.plan.memory_bound(), "learner_logp": mine,
           "stage_names": {s.stage: s.hf_names for s in sync.plan.stages},
           "counts": [len(s.buckets) for s in sync.plan.stages], **engine}  # fmt: skip
    sync.close()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [pytest.param({"tensor": 2, "pipeline": 2}, marks=pytest.mark.slow),  # as below
                                    pytest.param({"expert": 2, "pipeline": 2}, marks=pytest.mark.slow)],
                         ids=["tp2pp2", "ep2pp2"])  # fmt: skip
def test_four_rank_learner_pushes_each_stage_to_two_engines_and_logprobs_match(
    start_engine: Any, tiny_hf_dir: Any, layout: dict[str, int]
) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    engines = [start_engine(hf_dir), start_engine(hf_dir)]
    for e in engines:
        e.wait_healthy()
    urls = [e.url for e in engines]
    per_rank = spawn_ranks(_train_push_compare, 4, str(hf_dir), layout, urls, find_free_port(), timeout_s=600)
    m = per_rank[0]["metrics"]
    assert m["sync/failed"] == 0 and m["sync/engines"] == 2 and m["sync/stages"] == 2 and m["sync/flattened"] == 1
    assert m["sync/buckets"] >= 6, m  # 0.05 MB buckets: several per stage
    assert per_rank[0]["versions"] == [1, 1]
    stage_names = per_rank[0]["stage_names"]
    for groups in per_rank[0]["groups"]:  # what each engine received, per update group
        by_stage = {int(name.split("_pp")[1].split("_")[0]): rec for name, rec in groups.items()}
        assert set(by_stage) == {0, 1}
        for stage, rec in by_stage.items():
            assert sorted(rec["names"]) == sorted(stage_names[stage]), f"stage {stage} sent other layers"
        assert "model.embed_tokens.weight" in by_stage[0]["names"] and "model.norm.weight" in by_stage[1]["names"]
    # one order on every engine (SGLang receives one update at a time): round by round over the stages, then the
    # end-of-push marker on stage 0's group
    counts = per_rank[0]["counts"]
    expected = [s for k in range(max(counts)) for s, n in enumerate(counts) if k < n] + [0]
    for order in per_rank[0]["orders"]:
        assert [int(name.split("_pp")[1].split("_")[0]) for name in order] == expected
    logps = [r["learner_logp"] for r in per_rank if r["learner_logp"][0] is not None]
    assert logps, "no rank returned the learner's log-probs"
    for learner_logp, out in zip(logps[0], per_rank[0]["outs"]):
        assert out.versions == [1] * 10
        worst = max(abs(a - b) for a, b in zip(learner_logp, out.logprobs))
        assert worst <= LOGP_TOL, f"engine vs learner log-probs differ by {worst:.2e}"
    for r in per_rank:  # every rank's extra memory within two buckets + the largest tensor
        assert 0 < r["peak"] <= r["bound"] or (r["peak"] == 0 and r is not per_rank[0]), (r["peak"], r["bound"])


# ---- shard-aware pushes ------------------------------------------------------------------------------------------
def _full_and_sharded(hf_dir: str, layout: dict[str, int], full_url: str, sharded_url: str, port: int
                      ) -> dict[str, Any]:  # fmt: skip
    """The learner's weights changed (scaled: a train step at TP2 x EP2 x PP2 fails in megatron's gloo all-gather
    here, unrelated to the push), then pushed twice: whole tensors to one TP=2 engine, shard-aware (weight_sync.
    transfer auto) to the other."""
    import torch.distributed as dist

    cfg, learner = _learner(hf_dir, layout, port, bucket_mb=0.05)
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.mul_(1.25)
    out: dict[str, Any] = {}
    for key, url, transfer, offset in (("full", full_url, "full", 0), ("sharded", sharded_url, "auto", 40)):
        ws = type(cfg.weight_sync).model_validate(
            {
                **cfg.weight_sync.model_dump(),
                "transfer": transfer,
                "master_port": port + 100 + offset,
                "group_name": f"ws_{key}",
                "bucket_timeout_s": 60.0,
                "group_timeout_s": 180.0,
            }
        )
        sync = _sync(learner, cfg.model_copy(update={"weight_sync": ws}), [url])
        metrics = sync.push(1)
        out[key] = {"metrics": metrics, "peak": sync.peak_bytes,
                    "bound": sync.plan.memory_bound(rank_buffers=2 if transfer == "auto" else 0),
                    "names": sorted(n for s in sync.plan.stages for n in s.hf_names)}  # fmt: skip
        sync.close()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = {}
        for key, url in (("full", full_url), ("sharded", sharded_url)):
            c = SGLangClient(url)
            box[0][key] = {"gen": c.generate(PROMPT, {"max_new_tokens": 10, **GREEDY}),
                           "ranks": c.server_info()["tp_ranks"],
                           "checksums": [r["checksums"] for r in c.weights_checksum()["ranks"]],
                           "shards": c.weight_shards() if key == "sharded" else None}  # fmt: skip
    dist.broadcast_object_list(box, src=0)
    return {**out, "engines": box[0]}


def _expected_rank_bytes(hf_dir: str, names: list[str], table: dict[str, Any], dtype: torch.dtype) -> list[int]:
    """What each engine rank must receive from a shard-aware push of `names`: its block of every tensor the
    engine's /weight_shards lists, every other one whole (from the checkpoint's shapes)."""
    import math

    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), "pt") as st:
                shapes.update({k: st.get_slice(k).get_shape() for k in st.keys()})  # noqa: SIM118 (safe_open is not iterable)
    per_rank = []
    for r in range(table["tp_size"]):
        total = 0
        for n in names:
            boxes = table["shards"].get(n)
            shape = shapes[n] if boxes is None or boxes[r] is None else boxes[r][1]
            total += math.prod(shape) * dtype.itemsize
        per_rank.append(total)
    return per_rank


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("layout", "world"),
    [({"tensor": 2, "pipeline": 2}, 4),
     pytest.param({"tensor": 2, "expert": 2, "pipeline": 2}, 8, marks=pytest.mark.slow)],
    ids=["tp2pp2", "tp2ep2pp2"],
)  # fmt: skip
def test_a_shard_aware_push_sends_each_engine_rank_its_slice_and_serves_what_a_full_push_serves(
    start_engine: Any, tiny_hf_dir: Any, layout: dict[str, int], world: int
) -> None:
    """A multi-rank learner pushes the same weights whole to one TP=2 engine and shard-aware to another: each rank
    of the second received exactly its blocks and the replicated tensors (its update groups' traffic), at most 0.6x
    what a rank of the first received, rank 1's blocks broadcast by a relay rank beside the source; both engines
    then hold the same weights on every rank (checksums) and generate the same greedy tokens with exactly the same
    log-probs."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    full, sharded = start_engine(hf_dir, "--tp-size", "2"), start_engine(hf_dir, "--tp-size", "2")
    full.wait_healthy()
    sharded.wait_healthy()
    per_rank = spawn_ranks(_full_and_sharded, world, str(hf_dir), layout, full.url, sharded.url, find_free_port(),
                           timeout_s=900)  # fmt: skip
    out = per_rank[0]
    for key, sharded_push in (("full", 0.0), ("sharded", 1.0)):
        m = out[key]["metrics"]
        assert m["sync/failed"] == 0 and m["sync/stages"] == 2 and m["sync/sharded"] == sharded_push, (key, m)
    names = out["full"]["names"]
    engines = out["engines"]
    got = {k: [sum(g["bytes"] for g in r["weight_update_groups"].values()) for r in engines[k]["ranks"]]
           for k in ("full", "sharded")}  # fmt: skip
    whole = _expected_rank_bytes(str(hf_dir), names, {"tp_size": 2, "shards": {}}, torch.float32)
    assert got["full"] == whole, (got, whole)
    assert got["sharded"] == _expected_rank_bytes(str(hf_dir), names, engines["sharded"]["shards"], torch.float32)
    assert max(got["sharded"]) <= 0.6 * whole[0], got
    assert out["sharded"]["metrics"]["sync/engine_rank_mb_max"] == max(got["sharded"]) / 2**20
    # engine rank 1's block group is rooted at a relay (the stage's next rank on the source's host): its bytes leave
    # through that rank, not the source -- except the buckets every rank takes whole (the norms'), which leave the
    # source once over the stage's whole group
    m = out["sharded"]["metrics"]
    assert m["sync/whole_bytes"] > 0 and m["sync/relayed_bytes"] + m["sync/whole_bytes"] == got["sharded"][1], m
    assert out["full"]["metrics"]["sync/relayed_bytes"] == out["full"]["metrics"]["sync/whole_bytes"] == 0
    assert engines["full"]["checksums"] == engines["sharded"]["checksums"]
    a, b = engines["full"]["gen"], engines["sharded"]["gen"]
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and b.versions == [1] * 10
    for r in per_rank:  # the engine ranks' buffers stay within the bound of a shard-aware push
        assert r["sharded"]["peak"] <= r["sharded"]["bound"], (r["sharded"]["peak"], r["sharded"]["bound"])


# ---- failures: refused or cut at any bucket ---------------------------------------------------------------------
def _weights(client: SGLangClient, names: list[str]) -> dict[str, list]:
    return {n: client.get_weights_by_name(n, truncate_size=2) for n in names}


def _push_with_fault(hf_dir: str, url: str, port: int, fault: str, at: str, transfer: str = "auto") -> dict[str, Any]:
    """One rank: push version 1 (the reference), then version 2 with `fault` ('refuse' or 'cut') at bucket `at`
    ('last' or 'middle'); 'cut' ends this process mid-bucket like a crashed trainer."""
    from megatron_sao.weight_sync import sender as sender_mod

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, transfer=transfer)
    sync = _sync(learner, cfg, [url])
    client = SGLangClient(url)
    first = sync.push(1)
    buckets = len(sync.plan.stages[0].buckets)
    names = sync.plan.stages[0].hf_names
    before = {"weights": _weights(client, names), "version": client.weight_version()}
    target = buckets - 1 if at == "last" else buckets // 2
    real_start = sender_mod.StageSender.start
    real_update = SGLangClient.update_weights_from_distributed

    def start(self: Any, bucket: Any, buffer: torch.Tensor) -> Any:
        if bucket.index == target and fault == "cut":
            real_start(self, bucket, buffer)
            time.sleep(0.05)
            os._exit(17)  # the trainer dies with the bucket announced and partly sent
        if bucket.index == target and fault == "refuse":

            def bad(c: Any, names: list, *a: Any, **k: Any) -> Any:  # a tensor the engine's model does not have
                return real_update(c, ["model.no_such.weight", *names[1:]], *a, **k)

            SGLangClient.update_weights_from_distributed = bad  # type: ignore[method-assign]
            try:
                return real_start(self, bucket, buffer)
            finally:
                SGLangClient.update_weights_from_distributed = real_update  # type: ignore[method-assign]
        return real_start(self, bucket, buffer)

    sender_mod.StageSender.start = start  # type: ignore[method-assign]
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.mul_(1.5)
    refused = sync.push(2)
    sender_mod.StageSender.start = real_start  # type: ignore[method-assign]
    after = {"weights": _weights(client, names), "version": client.weight_version()}
    alive = client.generate(PROMPT, {"max_new_tokens": 4, **GREEDY})
    again = sync.push(3)
    final = {"version": client.weight_version(), "weights": _weights(client, names)}
    sync.close()
    return {"first": first, "buckets": buckets, "target": target, "before": before, "refused": refused,
            "after": after, "alive": alive, "again": again, "final": final}  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize("at", ["last", "middle"])
def test_a_push_refused_at_any_bucket_leaves_the_engine_as_it_was(start_engine: Any, tiny_hf_dir: Any, at: str) -> None:
    engine = start_engine(tiny_hf_dir("qwen3_moe"))
    engine.wait_healthy()
    (out,) = spawn_ranks(_push_with_fault, 1, str(tiny_hf_dir("qwen3_moe")), engine.url, find_free_port(), "refuse",
                         at, timeout_s=400)  # fmt: skip
    assert out["first"]["sync/failed"] == 0 and out["buckets"] >= 3 and out["before"]["version"] == 1
    assert out["refused"]["sync/failed"] == 1
    assert out["after"] == out["before"], "a refused push changed the engine's weights or version"
    assert out["alive"].versions == [1] * 4, "the engine must keep generating on the previous weights"
    assert out["again"]["sync/failed"] == 0 and out["final"]["version"] == 3
    assert out["final"]["weights"] != out["before"]["weights"]


@pytest.mark.multiproc
@pytest.mark.parametrize(("at", "transfer"), [pytest.param("last", "full", marks=pytest.mark.slow),  # as middle
                                              pytest.param("middle", "full", marks=pytest.mark.slow),  # as sharded
                                              ("middle", "sharded")])  # fmt: skip
def test_a_push_cut_at_any_bucket_leaves_the_engine_as_it_was(
    start_engine: Any, tiny_hf_dir: Any, at: str, transfer: str
) -> None:
    """The trainer process dies mid-bucket: the engine keeps the previous weights and version, notices the push is
    orphaned (its broadcast fails, or its session sits idle past --weight-session-timeout) and resumes generating,
    and a new trainer pushes to it (any stale session is dropped when the new group forms). sharded: a TP=2 engine
    whose ranks each receive only their blocks, over their block groups; cut mid-way, no rank keeps a block."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    tp = ("--tp-size", "2") if transfer == "sharded" else ()
    engine = start_engine(hf_dir, "--weight-session-timeout", "5", *tp)
    engine.wait_healthy()
    client = SGLangClient(engine.url)
    held = client.weights_checksum()["ranks"]
    with pytest.raises(RankFailure, match="exited with code 17"):
        spawn_ranks(_push_with_fault, 1, str(hf_dir), engine.url, find_free_port(), "cut", at, transfer,
                    timeout_s=400)  # fmt: skip
    assert client.weight_version() == 1, "a cut push changed the engine's version"
    out = client.generate(PROMPT, {"max_new_tokens": 4, **GREEDY}, timeout_s=60)
    assert out.versions == [1] * 4
    # version 1 is the checkpoint the engine loaded (pushed back unchanged): every rank holds exactly what it held
    assert client.weights_checksum()["ranks"] == held, "a cut push changed a rank's weights"
    (again,) = spawn_ranks(_push_with_fault, 1, str(hf_dir), engine.url, find_free_port(), "none", "last", transfer,
                           timeout_s=400)  # fmt: skip
    assert again["first"]["sync/failed"] == 0 and again["final"]["version"] == 3
    assert again["first"]["sync/sharded"] == float(transfer == "sharded")
    assert client.weights_checksum()["ranks"] != held


# ---- a generation across a push ----------------------------------------------------------------------------------
def _push_under_generation(hf_dir: str, url: str, port: int, pause_mode: str, transfer: str) -> dict[str, Any]:
    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.05, pause_mode=pause_mode, transfer=transfer)
    sync = _sync(learner, cfg, [url])
    client = SGLangClient(url)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=client.generate(PROMPT, {"max_new_tokens": 200, **GREEDY})))
    thread.start()
    deadline = time.monotonic() + 60
    while client.server_info()["load"]["generated_tokens"] < 10:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    metrics = sync.push(1)
    thread.join(120)
    sync.close()
    return {"metrics": metrics, "long": box.get("r"), "alive": client.health(),
            "protocol": client.protocol()}  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize(("release", "pause_mode", "transfer"), [
    ("0.5.23", "in_place", "full"), pytest.param("0.5.10", "in_place", "full", marks=pytest.mark.slow),  # as 0.5.5
    ("0.5.5", "abort", "full"),
    pytest.param("0.5.23", "none", "full", marks=pytest.mark.slow), ("0.5.23", "none", "sharded")])  # fmt: skip
def test_a_generation_in_flight_across_a_push_carries_two_versions_and_no_flush_is_asked(
    start_engine: Any, tiny_hf_dir: Any, release: str, pause_mode: str, transfer: str
) -> None:
    """0.5.23: session + flattened; 0.5.10: no session, and a flush refused while the request runs would kill it;
    0.5.5: per-tensor broadcasts and a pause that aborts; none: no pause, the staged push switches at one step;
    none + sharded: a TP=2 engine whose ranks receive only their blocks while the request goes on decoding."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    tp = ("--tp-size", "2") if transfer == "sharded" else ()
    engine = start_engine(hf_dir, "--emulate-sglang", release, *tp)
    engine.wait_healthy()
    (out,) = spawn_ranks(_push_under_generation, 1, str(hf_dir), engine.url, find_free_port(), pause_mode, transfer,
                         timeout_s=400)  # fmt: skip
    assert out["metrics"]["sync/failed"] == 0 and out["alive"], out["metrics"]
    assert out["metrics"]["sync/sharded"] == float(transfer == "sharded")
    assert out["metrics"]["sync/flattened"] == float(release != "0.5.5")
    long = out["long"]
    if pause_mode == "abort":  # SGLang before 0.5.6 ends running requests when it pauses
        assert long.finish_type == "abort" and set(long.versions) == {0}
        return
    assert len(long.output_ids) == 200
    switch = long.versions.index(1)
    assert 10 <= switch < 200 and long.versions == [0] * switch + [1] * (200 - switch)


def test_pause_in_place_is_refused_for_sglang_that_can_only_abort() -> None:
    from megatron_sao.config.weight_sync import WeightSyncConfig
    from megatron_sao.weight_sync.engines import EngineSet

    class Old(SGLangClient):
        def server_info(self) -> dict[str, Any]:
            return {"version": "0.5.5", "tp_size": 1, "dp_size": 1}

    engines = EngineSet(WeightSyncConfig(pause_mode="in_place"), ["http://127.0.0.1:9"], "gloo", 1)
    engines.clients = {u: Old(u) for u in engines.clients}
    with pytest.raises(ValueError, match="weight_sync.pause_mode='in_place'.*only pause by aborting"):
        engines._describe("http://127.0.0.1:9")

    class DataParallel(Old):
        def server_info(self) -> dict[str, Any]:
            return {"version": "0.5.23", "tp_size": 2, "dp_size": 2}

    engines.clients = {u: DataParallel(u) for u in engines.clients}
    with pytest.raises(RuntimeError, match="--dp-size 2 without --enable-dp-attention"):
        engines._describe("http://127.0.0.1:9")


@pytest.mark.multiproc
@pytest.mark.slow  # 15-75 s: under spawn_ranks the survivor is freed ~55 s after the kill in some runs (not yet
# understood; run as a plain script it is freed at once). Default-tier cover: test_a_push_cut_at_any_bucket_*,
# tests/weight_sync/test_engine_set.py's failure handling, tests/weight_sync/test_agent.py's agent killed mid-push.
def test_an_engine_killed_mid_push_fails_the_push_and_the_next_goes_to_the_others(
    start_engine: Any, tiny_hf_dir: Any
) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    engines = [start_engine(hf_dir), start_engine(hf_dir)]
    for e in engines:
        e.wait_healthy()
    (out,) = spawn_ranks(_kill_mid_push, 1, str(hf_dir), [e.url for e in engines], engines[1].proc.pid,
                         find_free_port(), timeout_s=400)  # fmt: skip
    assert out["first"]["sync/failed"] == 1, out["first"]
    assert out["second"]["sync/failed"] == 0 and out["second"]["sync/engines"] == 1
    assert out["version"] == 2
    # the source aborted its broken group before reporting, so before rank 0 asked any engine to drop it
    assert out["events"][:2] == ["abort", "abandon"], out["events"]
    # the group's collective timeout (NCCL's watchdog) is weight_sync.group_timeout_s, beyond the bucket timeout
    assert out["group_timeout_s"] == 900.0


def _kill_mid_push(hf_dir: str, urls: list[str], victim: int, port: int) -> dict[str, Any]:
    from megatron_sao.weight_sync import engines as engines_mod
    from megatron_sao.weight_sync import sender as sender_mod

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, bucket_timeout_s=60.0, group_timeout_s=900.0)
    sync = _sync(learner, cfg, urls)
    real_start = sender_mod.StageSender.start
    events: list[str] = []
    real_abort, real_abandon = sender_mod.abort_update_group, engines_mod.EngineSet.abandon
    sender_mod.abort_update_group = lambda group: (events.append("abort"), real_abort(group))[1]  # type: ignore
    engines_mod.EngineSet.abandon = lambda self, *a, **k: (events.append("abandon"),  # type: ignore[method-assign]
                                                            real_abandon(self, *a, **k))[1]  # fmt: skip

    def start(self: Any, bucket: Any, buffer: torch.Tensor) -> Any:
        if bucket.index == 2:
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.2)
        return real_start(self, bucket, buffer)

    sender_mod.StageSender.start = start  # type: ignore[method-assign]
    first = sync.push(1)
    sender_mod.StageSender.start = real_start  # type: ignore[method-assign]
    second = sync.push(2)
    assert sync.sender is not None
    group_timeout = sync.sender.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    version = SGLangClient(urls[0]).weight_version()
    sync.close()
    return {"first": first, "second": second, "version": version, "events": events, "group_timeout_s": group_timeout}


# ---- an FP8 engine ------------------------------------------------------------------------------------------------
FP8_LOGP_TOL = 0.1  # nats per token: block-FP8 (e4m3, 16x16 blocks) engine vs fp32 engine on the same pushed weights


def _step_and_push(hf_dir: str, url: str, fp8_dir: str | None, port: int) -> dict[str, Any]:
    """One deterministic learner step (the same weights in every process), pushed to one engine: quantized into
    the FP8 checkpoint's format when `fp8_dir` is given, else as fp32; then the engine's greedy generation."""
    from megatron_sao.learner.synthetic import make_batch
    from megatron_sao.models.fp8 import checkpoint_format
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.05)
    learner.train_step(on_policy(make_batch(6, seed=3), hf_dir))
    fmt = checkpoint_format(fp8_dir) if fp8_dir else None
    sync = WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.float32),
                      cfg.weight_sync, [url], layout=learner.layout, fp8_format=fmt)  # fmt: skip
    out: dict[str, Any] = {"push": sync.push(learner.version)}
    engine = SGLangClient(url)
    out["gen"] = engine.generate(PROMPT, {"max_new_tokens": 12, **GREEDY})
    out["version"] = engine.weight_version()
    out["fp8_tensors"] = sum(1 for s in sync.plan.stages for b in s.buckets for e in b.hf
                             if e.dtype == torch.float8_e4m3fn)  # fmt: skip
    out["quantized_names"] = len(fmt.names) if fmt else 0
    sync.close()
    return out


@pytest.mark.multiproc
def test_an_fp8_engine_takes_pushes_quantized_into_its_checkpoint_format(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Any
) -> None:
    """The learner's fp32 weights quantized by the stage source into the engine's block-FP8 format (weights +
    scales, verified by checksum), the FP8 engine's greedy log-probs within FP8_LOGP_TOL of an fp32 engine fed the
    same step; a plain (unquantized) push to the FP8 engine would be refused tensor by tensor (dtype)."""
    from megatron_sao.models.fp8 import write_checkpoint

    hf_dir = tiny_hf_dir("qwen3_moe")
    fp8_dir = tmp_path / "fp8"
    write_checkpoint(hf_dir, fp8_dir, block=(16, 16))
    engines = [start_engine(hf_dir), start_engine(fp8_dir)]
    for e in engines:
        e.wait_healthy()
    (plain,) = spawn_ranks(_step_and_push, 1, str(hf_dir), engines[0].url, None, find_free_port(), timeout_s=400)
    (quant,) = spawn_ranks(_step_and_push, 1, str(hf_dir), engines[1].url, str(fp8_dir), find_free_port(),
                           timeout_s=400)  # fmt: skip
    assert plain["push"]["sync/failed"] == 0 and quant["push"]["sync/failed"] == 0, (plain["push"], quant["push"])
    assert plain["version"] == quant["version"] == 1
    assert quant["fp8_tensors"] == quant["quantized_names"] > 0 and plain["fp8_tensors"] == 0
    ref, q = plain["gen"], quant["gen"]
    same = next((i for i, (a, b) in enumerate(zip(ref.output_ids, q.output_ids)) if a != b), len(ref.output_ids))
    assert same >= 4, (ref.output_ids, q.output_ids)  # greedy paths agree at least at first
    worst = max(abs(a - b) for a, b in zip(ref.logprobs[:same], q.logprobs[:same]))
    print(f"fp8 vs fp32 engine: {same} tokens agree, worst log-prob gap {worst:.4f}")
    assert worst <= FP8_LOGP_TOL, f"FP8 engine vs fp32 engine log-probs differ by {worst:.3f}"


@pytest.mark.multiproc
def test_a_dense_model_pushed_from_a_tp2_learner_serves_the_learners_log_probs(
    start_engine: Any, tmp_path: Any
) -> None:
    """The dense families (issue 49), Llama with tied embeddings (SmolLM2's layout): a TP=2 learner steps and pushes
    to a TP=1 engine and a TP=2 engine (each its shard-aware blocks; the tied embedding travels once, as
    embed_tokens); both then generate the same greedy tokens at the new version, with the learner's log-probs."""
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = make_tiny_model("llama", tmp_path / "llama", seed=1, tie_embeddings=True)
    engines = [start_engine(hf_dir), start_engine(hf_dir, "--tp-size", "2")]
    for e in engines:
        e.wait_healthy()
    per_rank = spawn_ranks(_train_push_compare, 2, str(hf_dir), {"tensor": 2}, [e.url for e in engines],
                           find_free_port(), timeout_s=600)  # fmt: skip
    m = per_rank[0]["metrics"]
    assert m["sync/failed"] == 0 and m["sync/engines"] == 2 and m["sync/sharded"] == 1, m
    assert per_rank[0]["versions"] == [1, 1]
    outs = per_rank[0]["outs"]
    assert outs[0].output_ids == outs[1].output_ids and outs[0].versions == [1] * 10
    logps = [r["learner_logp"] for r in per_rank if r["learner_logp"][0] is not None][0]
    for learner_logp, out in zip(logps, outs):
        worst = max(abs(a - b) for a, b in zip(learner_logp, out.logprobs))
        assert worst <= LOGP_TOL, f"engine vs learner log-probs differ by {worst:.2e}"
