"""Rank 0's view of the engines across pushes (weight_sync/engines.py), against fake SGLang clients that record
what they are asked: an engine that holds a partial push stays paused until a complete push lands on it, whatever
fails in between; pause_mode none is refused where requests would run on mixed weights."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.engines.client import EngineError, SGLangClient
from megatron_sao.engines.protocol import EMBEDDED_ENGINE, ServerProtocol, checksum_device
from megatron_sao.weight_sync.engines import EngineSet
from megatron_sao.weight_sync.sender import GroupSpec, Member, WeightSyncError

URLS = ["http://127.0.0.1:9", "http://127.0.0.1:10"]


class FakeEngine(SGLangClient):
    """Answers every control call with success and records it."""

    version = "0.5.23"
    engine: str | None = None

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def _ok(self, name: str) -> dict[str, Any]:
        self.calls.append(name)
        return {"success": True, "message": "ok"}

    commits: int | None = None  # the embedded engine's weight_commits (None: not shown, as SGLang)
    held_version = 3

    def server_info(self) -> dict[str, Any]:
        info = {"version": self.version, "tp_size": 1, "dp_size": 1, "engine": self.engine}
        return info if self.commits is None else {**info, "weight_commits": self.commits}

    def weight_version(self) -> int:
        return self.held_version

    norms: dict[str, str] | None = None  # what /weights_checker shows of the norms (None: the call fails)
    skipped: list[str] | None = None

    def weights_checksum(self, skip_tensor_list: list[str] | None = None) -> dict[str, Any]:
        self.skipped = skip_tensor_list
        if self.norms is None:
            raise EngineError("POST /weights_checker: 404")
        return {"success": True, "ranks": [{"checksums": dict(self.norms)}]}

    def health(self, timeout_s: float | None = None) -> bool:
        return True

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._ok(f"pause:{mode}")

    def continue_generation(self) -> Any:
        return self._ok("continue")

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._ok("destroy")

    def begin_weight_update(self) -> Any:
        return self._ok("begin")

    def end_weight_update(self) -> Any:
        return self._ok("end")


def _engines(**cfg: Any) -> EngineSet:
    engines = EngineSet(WeightSyncConfig(**cfg), URLS, "gloo", 1, updates=4)
    engines.clients = {u: FakeEngine(u) for u in URLS}
    return engines


def _spec(protocol: ServerProtocol) -> GroupSpec:
    members = tuple(Member(u, protocol, 1, 1 + i) for i, u in enumerate(URLS))
    return GroupSpec(members=members, attempt=0, num_stages=1, group_name="g", master_port=1, master_addr="auto",
                     backend="gloo", load_format=None, connect_timeout_s=10.0, bucket_timeout_s=10.0)  # fmt: skip


def test_a_quarantined_engine_stays_paused_through_later_failures_until_a_push_lands() -> None:
    engines = _engines()
    spec = _spec(ServerProtocol("0.5.23"))  # real SGLang: a partial push stays in its live weights
    a, b = URLS
    engines.abandon(spec, "stage 0: bucket 3 failed", touched={a})  # a got part of the push, b nothing
    assert engines.quarantined == {a}
    assert "continue" not in engines.clients[a].calls and "continue" in engines.clients[b].calls
    # the next push fails before any update reaches an engine (a connect or begin failure): a stays out of service
    for client in engines.clients.values():
        client.calls.clear()
    engines.abandon(spec, "could not form update group", touched=set())
    assert engines.quarantined == {a}, "a failure that touched nothing must not release a partially updated engine"
    assert "continue" not in engines.clients[a].calls
    # a complete push lands on both: a serves again
    engines.conclude(spec, {}, touched={a, b}, version=3)
    assert engines.quarantined == set() and "continue" in engines.clients[a].calls
    assert engines.held == {a: 3, b: 3}


def test_pause_mode_none_is_refused_for_sglang_pushes_of_several_updates() -> None:
    engines = _engines(pause_mode="none")
    with pytest.raises(ValueError, match=r"weight_sync.pause_mode='none'.*4 updates.*mixed weights"):
        engines._describe(URLS[0])
    one = EngineSet(WeightSyncConfig(pause_mode="none"), URLS, "gloo", 1, updates=1)
    one.clients = {u: FakeEngine(u) for u in URLS}
    assert one._describe(URLS[0])[0].version == "0.5.23"  # a one-update push switches at once: allowed
    embedded = _engines(pause_mode="none")
    for client in embedded.clients.values():
        client.engine = EMBEDDED_ENGINE  # stages the whole push and switches at its end
    assert embedded._describe(URLS[0])[0].staged


def test_pause_mode_auto_leaves_engines_that_stage_a_push_decoding_and_pauses_sglang_in_place() -> None:
    """auto, per engine: the embedded engine with sessions (stages, switches at one step) is neither paused nor
    continued and is asked no flush; SGLang 0.5.23 is paused in place (no flush: its requests keep their KV);
    SGLang before 0.5.6 can only abort (and then its cache is flushed)."""
    engines = _engines()
    staged, sglang = ServerProtocol("0.5.23", embedded=True), ServerProtocol("0.5.23")
    assert [engines.pause_mode(p) for p in (staged, sglang, ServerProtocol("0.5.5"))] == ["none", "in_place", "abort"]
    assert engines.pause_mode(ServerProtocol("0.5.10", embedded=True)) == "in_place"  # no session: applied live
    spec = _spec(staged)
    mixed = GroupSpec(members=(spec.members[0], Member(URLS[1], sglang, 1, 2)), attempt=0, num_stages=1,
                      group_name="g", master_port=1, master_addr="auto", backend="gloo", load_format=None,
                      connect_timeout_s=10.0, bucket_timeout_s=10.0)  # fmt: skip
    assert engines.open(mixed) is None
    a, b = (engines.clients[u] for u in URLS)
    assert not any(c.startswith("pause") for c in a.calls) and "pause:in_place" in b.calls
    engines.conclude(mixed, {}, touched=set(URLS), version=2)
    assert "continue" not in a.calls and "continue" in b.calls
    assert _engines(pause_mode="retract").pause_mode(staged) == "retract"  # a mode given is a mode kept


class CheckingEngine(FakeEngine):
    """An SGLang engine at TP=2 whose /weights_checker shows per-rank checksums of its internal parameters (the norms
    under their HF names), and whose /get_weights_by_name serves `rows`."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranks: list[dict[str, str]] = [{}, {}]
        self.rows: dict[str, list] = {}

    def weights_checksum(self, skip_tensor_list: list[str] | None = None) -> dict[str, Any]:
        return {"success": True, "ranks": [{"checksums": dict(r)} for r in self.ranks]}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self.rows.get(name)  # SGLang answers null for a model class that cannot show it


def _sums(gpu: str) -> dict[str, str]:
    return {"cpu": f"sha-{gpu}", "cuda": gpu}  # a sample's two checksums as sent (flat_bucket.sglang_checksums)


def _reports() -> list[Any]:
    from megatron_sao.weight_sync.engines import StageReport

    first = StageReport(0, samples={"model.layers.0.input_layernorm.weight": [1.0, 2.0]},
                        sample_checksums={"model.layers.0.input_layernorm.weight": _sums("aa")})  # fmt: skip
    last = StageReport(
        1,
        samples={"model.norm.weight": [3.0], "model.layers.2.input_layernorm.weight": [4.0]},
        sample_checksums={"model.norm.weight": _sums("cc"), "model.layers.2.input_layernorm.weight": _sums("dd")},
    )
    return [first, last]


def test_every_stage_is_verified_on_every_engine_rank_before_a_version_is_live() -> None:
    engines = _engines(verify="auto")
    engines.clients = {u: CheckingEngine(u) for u in URLS}
    spec = _spec(ServerProtocol("0.5.23"))
    good = {"model.layers.0.input_layernorm.weight": "aa", "model.norm.weight": "cc",
            "model.layers.2.input_layernorm.weight": "dd"}  # fmt: skip
    for client in engines.clients.values():
        client.ranks = [dict(good), dict(good)]
    assert engines._verify(spec, _reports(), tied=False, skip=set()) == {}
    # stage 1's layer-2 norm did not land on TP rank 1 of the second engine: that engine is not marked live
    engines.clients[URLS[1]].ranks[1]["model.layers.2.input_layernorm.weight"] = "stale"
    bad = engines._verify(spec, _reports(), tied=False, skip=set())
    assert list(bad) == [URLS[1]] and "stage 1" in bad[URLS[1]] and "rank(s) [1]" in bad[URLS[1]]
    # a release without /weights_checker: the first rows are compared; a stage-0 row that differs is caught
    old = _spec(ServerProtocol("0.5.5"))
    for client in engines.clients.values():
        client.rows = {"model.layers.0.input_layernorm.weight": [1.0, 2.0], "model.norm.weight": [3.0],
                       "model.layers.2.input_layernorm.weight": [4.0]}  # fmt: skip
    assert engines._verify(old, _reports(), tied=False, skip=set()) == {}
    engines.clients[URLS[0]].rows["model.layers.0.input_layernorm.weight"] = [1.0, 2.5]
    bad = engines._verify(old, _reports(), tied=False, skip=set())
    assert list(bad) == [URLS[0]] and "stage 0" in bad[URLS[0]]


def test_sglang_on_gpus_is_checked_with_its_own_kernel_hash_and_on_cpu_with_sha256() -> None:
    """SGLang hashes CUDA tensors with gpu_tensor_hash, CPU tensors with sha256: a Qwen3-MoE engine on GPUs (no
    /get_weights_by_name rows) whose checker shows the kernel hash of what was sent is live; the sha256 of the same
    tensor on such an engine is a real difference. /server_info's device says which."""
    import torch

    from megatron_sao.distributed import flat_bucket
    from megatron_sao.weight_sync.engines import StageReport

    norm = torch.linspace(0.5, 1.5, 64, dtype=torch.bfloat16)
    sums = flat_bucket.sglang_checksums(norm)
    assert sums["cuda"] == flat_bucket.gpu_tensor_checksum(norm) != sums["cpu"] == flat_bucket.tensor_checksum(norm)
    reports = [StageReport(0, samples={"model.norm.weight": norm[:8].float().tolist()},
                           sample_checksums={"model.norm.weight": sums})]  # fmt: skip
    engines = _engines(verify="auto")
    engines.clients = {u: CheckingEngine(u) for u in URLS}
    gpu, cpu = engines.clients.values()
    cpu.server_info = lambda: {**FakeEngine.server_info(cpu), "device": "cpu"}  # type: ignore[method-assign]
    for url in URLS:
        engines._describe(url)
    assert engines.devices == {URLS[0]: "cuda", URLS[1]: "cpu"}  # no device given: SGLang's auto-detection, a GPU
    assert checksum_device({"device": "cuda:1"}) == "cuda" and checksum_device({"engine": EMBEDDED_ENGINE}) == "cpu"
    gpu.ranks = [{"model.norm.weight": sums["cuda"]}] * 2
    cpu.ranks = [{"model.norm.weight": sums["cpu"]}] * 2
    spec = _spec(ServerProtocol("0.5.23"))
    assert engines._verify(spec, reports, tied=False, skip=set()) == {} and engines.unverified == []
    gpu.ranks = [{"model.norm.weight": sums["cpu"]}] * 2  # what the sha256 comparison sent before
    bad = engines._verify(spec, reports, tied=False, skip=set())
    assert list(bad) == [URLS[0]] and "rank(s) [0, 1]" in bad[URLS[0]]


def test_a_sample_no_engine_can_show_is_unverified_counted_and_not_a_bad_engine() -> None:
    engines = _engines(verify="auto")
    engines.clients = {u: CheckingEngine(u) for u in URLS}  # checker rows for nothing, no /get_weights_by_name rows
    spec = _spec(ServerProtocol("0.5.23"))
    assert engines._verify(spec, _reports(), tied=False, skip=set()) == {}
    assert len(engines.unverified) == 2 * 3  # every sample of both stages on both engines
    for client in engines.clients.values():
        client.weights_checksum = lambda skip_tensor_list=None: {"success": True, "ranks": []}  # type: ignore
    assert engines._verify(spec, _reports(), tied=False, skip=set()) == {} and len(engines.unverified) == 6
    for client in engines.clients.values():
        client.rows = {"model.layers.0.input_layernorm.weight": [1.0, 2.0], "model.norm.weight": [3.0],
                       "model.layers.2.input_layernorm.weight": [4.0]}  # fmt: skip
    assert engines._verify(spec, _reports(), tied=False, skip=set()) == {} and engines.unverified == []


def test_each_stage_samples_its_first_norm_beside_the_configured_tensors() -> None:
    from megatron_sao.weight_sync.sync import stage_samples

    first = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"]  # fmt: skip
    last = ["model.layers.2.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]
    assert stage_samples(first, ["model.norm.weight"]) == ["model.layers.0.input_layernorm.weight"]
    assert stage_samples(last, ["model.norm.weight"]) == ["model.norm.weight", "model.layers.2.input_layernorm.weight"]


class ShardedEngine(FakeEngine):
    """An engine at TP=2 that answers /health and, as the embedded engine, /weight_shards (`tp_size` as told)."""

    tp = 2
    shards_tp = 2

    def health(self, timeout_s: float = 5.0) -> bool:
        return True

    def weight_version(self) -> Any:
        return None

    def server_info(self) -> dict[str, Any]:
        return {**super().server_info(), "tp_size": self.tp}

    def weight_shards(self) -> dict[str, Any]:
        return {"tp_size": self.shards_tp, "shards": {"model.layers.0.self_attn.q_proj.weight": [
            [[0, 0], [4, 8]], [[4, 0], [4, 8]]]}}  # fmt: skip


def _sharded_engines(engine: str | None, **cfg: Any) -> EngineSet:
    engines = EngineSet(WeightSyncConfig(**cfg), URLS, "gloo", 1, updates=4)
    engines.clients = {u: ShardedEngine(u) for u in URLS}
    for client in engines.clients.values():
        client.engine = engine
    return engines


def test_the_transfer_is_shard_aware_only_where_every_engine_takes_per_rank_blocks() -> None:
    """auto: embedded engines at TP=2 get per-rank blocks (their /weight_shards kept per member, ranks numbered
    as before); SGLang engines full tensors; transfer='sharded' refuses SGLang naming the field; an engine whose
    table does not match its TP size is left out, naming it."""
    spec, reform = _sharded_engines(EMBEDDED_ENGINE).plan()
    assert reform and spec.load_format == "sharded_bucket"
    assert [(m.offset, m.tp) for m in spec.members] == [(1, 2), (3, 2)]
    q = spec.members[0].shards["model.layers.0.self_attn.q_proj.weight"]
    assert q == (((0, 0), (4, 8)), ((4, 0), (4, 8)))
    assert spec.members[0].boxes(1, {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}) == {
        "model.layers.0.self_attn.q_proj.weight": ((4, 0), (4, 8))}  # fmt: skip
    assert _sharded_engines(EMBEDDED_ENGINE, transfer="full").plan()[0].load_format == "flattened_bucket"
    assert _sharded_engines(None).plan()[0].load_format == "flattened_bucket"  # SGLang: whole tensors
    with pytest.raises(ValueError, match=r"weight_sync.transfer='sharded'.*take only full tensors"):
        _sharded_engines(None, transfer="sharded").plan()
    bad = _sharded_engines(EMBEDDED_ENGINE)
    bad.clients[URLS[1]].shards_tp = 4
    spec, _ = bad.plan()
    assert [m.url for m in spec.members] == [URLS[0]]
    bad.clients[URLS[0]].shards_tp = 4
    bad.spec = None
    with pytest.raises(WeightSyncError, match=r"tp_size 4.*says 2"):
        bad.plan()


def test_engine_ranks_that_hold_the_same_blocks_share_one_block_group() -> None:
    """Rank r of every engine at one TP size holds the same blocks: one block group (one broadcast) per r, in member
    order; an engine at another TP size (other blocks) gets groups of its own; a full-tensor push has none."""
    spec, _ = _sharded_engines(EMBEDDED_ENGINE).plan()
    assert spec.block_groups == [[1, 3], [2, 4]]
    assert replace(spec, load_format="flattened_bucket").block_groups is None
    q = "model.layers.0.self_attn.q_proj.weight"
    other = Member("http://c:1", spec.members[0].protocol, 4, 5, {q: tuple(((2 * r, 0), (2, 8)) for r in range(4))})
    mixed = replace(spec, members=(*spec.members, other))
    assert mixed.block_groups == [[1, 3], [2, 4], [5], [6], [7], [8]]
    whole = Member("http://d:1", spec.members[0].protocol, 1, 9, {})  # TP=1: everything whole
    assert replace(spec, members=(*spec.members, whole)).block_groups == [[1, 3], [2, 4], [9]]


def test_a_sharded_transfer_cannot_go_one_tensor_per_broadcast() -> None:
    with pytest.raises(ValueError, match=r"transfer='sharded'.*load_format='per_tensor'"):
        WeightSyncConfig(transfer="sharded", load_format="per_tensor")


class GroupHoldingEngine(ShardedEngine):
    """An SGLang engine at TP=1 that holds update groups as SGLang does: joined ones stay until destroyed by name
    (SGLang frees a group's communicators only on /destroy_weights_update_group); restarting empties it."""

    tp = 1

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.groups: set[str] = set()
        self.alive = True

    def health(self, timeout_s: float = 5.0) -> bool:
        return self.alive

    def destroy_weights_update_group(self, group_name: str) -> Any:
        if group_name not in self.groups:
            raise EngineError("The group to be destroyed does not exist.")
        self.groups.discard(group_name)
        return self._ok("destroy")


def test_update_groups_of_an_earlier_membership_are_destroyed_on_the_engines_that_stay() -> None:
    """Three membership changes (an engine starts, one dies, the dead one comes back restarted) and a push that
    failed verification: after each push every live engine holds exactly the current push's groups, one per stage."""
    urls = [*URLS, "http://127.0.0.1:11"]
    engines = EngineSet(WeightSyncConfig(), urls, "gloo", num_stages=2, updates=4)
    fakes = {u: GroupHoldingEngine(u) for u in urls}
    engines.clients = dict(fakes)
    fakes[urls[2]].alive = False  # starts later

    def push() -> GroupSpec:
        spec, reform = engines.plan()
        if reform:  # what the stage senders do: every member joins every stage's group
            for m in spec.members:
                fakes[m.url].groups |= {spec.name(s) for s in range(spec.num_stages)}
        engines.conclude(spec, {}, touched={m.url for m in spec.members}, version=1)
        return spec

    def live_groups() -> dict[str, int]:
        return {u: len(f.groups) for u, f in fakes.items() if f.alive}

    push()
    assert live_groups() == {urls[0]: 2, urls[1]: 2}
    fakes[urls[2]].alive = True  # 1: an engine starts
    spec = push()
    assert len(spec.members) == 3 and live_groups() == {u: 2 for u in urls}
    fakes[urls[1]].alive = False  # 2: one dies
    push()
    assert live_groups() == {urls[0]: 2, urls[2]: 2}
    fakes[urls[1]] = engines.clients[urls[1]] = GroupHoldingEngine(urls[1])  # 3: it comes back, restarted
    spec = push()
    assert len(spec.members) == 3 and live_groups() == {u: 2 for u in urls}
    assert all(f.groups == {spec.name(0), spec.name(1)} for f in fakes.values())
    # a push that failed on one engine forms the groups again at the next push: the old ones go first
    engines.conclude(spec, {urls[0]: "verify: differs"}, touched=set(urls), version=2)
    spec = push()
    assert all(f.groups == {spec.name(0), spec.name(1)} for f in fakes.values()) and spec.attempt == 4
    engines.close()
    assert live_groups() == {u: 0 for u in urls}


def test_deltas_go_only_to_engines_that_take_them_and_only_against_a_base_every_engine_reports() -> None:
    """weight_sync.delta: SGLang's own ranks take no deltas (auto: full pushes; delta: refused, naming the field); the
    embedded engine takes them, against the version the last push that landed everywhere left as the base, and only
    while every engine reports holding it (/server_info weight_delta_base); a failed push resets it."""
    from megatron_sao.engines.protocol import DELTA_BASE_INFO
    from megatron_sao.weight_sync.sender import FLATTENED

    sglang = replace(_spec(ServerProtocol("0.5.23")), load_format=FLATTENED)
    assert _engines(delta="auto").deltas(sglang) is None
    with pytest.raises(ValueError, match="weight_sync.delta='delta'.*push agent"):
        _engines(delta="delta").deltas(sglang)
    embedded = replace(_spec(ServerProtocol("0.5.23", embedded=True)), load_format=FLATTENED)
    assert _engines(delta="full").deltas(embedded) is None
    engines = _engines(delta="auto")
    held: dict[str, Any] = {u: None for u in URLS}
    for client in engines.clients.values():
        client.server_info = lambda u=client.url: {"version": "0.5.23", "tp_size": 1, DELTA_BASE_INFO: held[u]}  # type: ignore[method-assign]
    first = engines.deltas(embedded)
    assert first is not None and first.base is None  # nothing kept yet: whole, and kept
    engines.conclude(embedded, {}, touched=set(URLS), version=1)
    held.update(dict.fromkeys(URLS, 1))
    assert engines.deltas(embedded).base == 1  # type: ignore[union-attr]
    held[URLS[1]] = None  # restarted: no base
    assert engines.deltas(embedded).base is None  # type: ignore[union-attr]
    engines.conclude(embedded, {URLS[0]: "end_weight_update: refused"}, touched=set(URLS), version=2)
    held.update(dict.fromkeys(URLS, 1))
    assert engines.delta_base is None and engines.deltas(embedded).base is None  # type: ignore[union-attr]


def test_an_engine_whose_weights_a_push_not_ours_changed_is_counted_and_gets_a_whole_push() -> None:
    """Issue 46 item 8: anyone with the key could push under the current weight_version and nothing noticed. The
    embedded engine counts the updates it applied (/server_info weight_commits); one that moved since our last push
    landed is logged, counted (sync/changed_under), its groups are formed again and the next push is whole."""
    engines = _engines()
    protocol = ServerProtocol("0.5.23", embedded=True)
    spec = _spec(protocol)
    a, b = URLS
    for client in engines.clients.values():
        client.commits = 5
    engines.spec = spec
    engines.delta = None
    engines.conclude(spec, {}, touched={a, b}, version=3)
    assert engines.commits == {a: 5, b: 5} and engines._same(list(URLS))
    engines.delta_base = 3
    engines.clients[a].commits = 6  # someone pushed into a
    assert not engines._same(list(URLS)), "a changed engine must take a whole push over new groups"
    assert engines.changed_under == [a] and engines.delta_base is None and a not in engines.commits
    for client in engines.clients.values():
        client.held_version = 4
    engines.conclude(spec, {}, touched={a, b}, version=4)  # the whole push landed: a is counted again
    assert engines.commits == {a: 6, b: 5} and engines._same(list(URLS))
    # SGLang without /weights_checker answers: nothing recorded, nothing claimed
    sglang = _engines()
    sglang.spec = _spec(ServerProtocol("0.5.23"))
    sglang.conclude(sglang.spec, {}, touched=set(URLS), version=3)
    assert sglang.commits == {} and sglang.norms == {} and sglang._same(list(URLS))


def test_an_sglang_engine_whose_norms_a_push_not_ours_changed_is_counted_and_gets_a_whole_push() -> None:
    """SGLang counts no commits: the learner keeps what /weights_checker shows of each engine's norms when its push
    lands (the big weights skipped) and compares at the next look. A changed norm is a push not ours (logged,
    counted, whole push over new groups); a checker that fails later claims nothing; a release without the checker
    (before 0.5.6) is not watched."""
    engines = _engines()
    spec = _spec(ServerProtocol("0.5.23"))
    a, b = URLS
    for client in engines.clients.values():
        client.norms = {"model.norm.weight": "11", "model.layers.0.input_layernorm.weight": "22"}
    engines.spec = spec
    engines.delta = None
    engines.conclude(spec, {}, touched={a, b}, version=3)
    assert engines.commits == {} and set(engines.norms) == {a, b} and engines._same(list(URLS))
    assert "experts" in engines.clients[a].skipped and "proj" in engines.clients[a].skipped, "only norms hashed"
    engines.clients[b].norms = {**engines.clients[b].norms, "model.norm.weight": "0"}  # someone pushed into b
    engines.clients[a].norms = None  # a's checker fails this time: not a change
    assert not engines._same(list(URLS))
    assert engines.changed_under == [b] and b not in engines.norms and a in engines.norms
    engines.clients[a].norms = {"model.norm.weight": "11", "model.layers.0.input_layernorm.weight": "22"}
    for client in engines.clients.values():
        client.held_version = 4
    engines.conclude(spec, {}, touched={a, b}, version=4)  # the whole push landed: b is watched again
    assert engines.norms[b] == [{"model.norm.weight": "0", "model.layers.0.input_layernorm.weight": "22"}]
    assert engines._same(list(URLS))
    old = _engines()
    old.spec = _spec(ServerProtocol("0.5.5"))
    for client in old.clients.values():
        client.norms = {"model.norm.weight": "11"}
    old.conclude(old.spec, {}, touched=set(URLS), version=3)
    assert old.norms == {} and old._same(list(URLS))
