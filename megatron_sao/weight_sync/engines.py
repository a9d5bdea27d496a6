"""The engines' side of a push, as learner rank 0 drives it over HTTP (owned by weight_sync/; used by sync.py):
who takes part, what each engine's SGLang release allows, and the session around the stages' buckets.

    deltas():  whether this push's buckets travel as deltas (weight_sync.delta): against the version the stage
               sources' bases hold, when every engine reports holding it too (/server_info `weight_delta_base`);
               else whole, kept as the next bases. Any failed push resets it: the next one goes whole.
    plan():    the engines answering /health, each with its protocol (from /server_info's version), its TP size
               (ranks in every update group) and its DP size; a new GroupSpec when that set changed or the last
               push failed (the groups are then formed again).
    open():    pause (weight_sync.pause_mode, per engine: auto leaves engines that stage a push decoding; SGLang
               before 0.5.6 can only abort) and, from 0.5.21, begin the weight-update session on every engine.
    finish():  when every stage landed: the end-of-push marker (weight_version), end the sessions (the embedded
               engine commits its staged push here, weights and version at one decode step), verify what each engine
               now holds (weight_sync.verify), continue generation. An engine that fails any of it is not marked live.
    abandon(): when a stage failed: the engines drop every update group (the embedded engine discards its staged
               session with it) and close their sessions; engines that could not have been touched, and the
               embedded ones (nothing of the push was applied), continue; a real SGLang engine that received part of
               the push is "partially updated" and stays paused -- out of service, its version behind the others so
               the rollout router keeps work off it -- until a complete push lands.
A flush is asked for only with pause_mode abort or retract (no request holds KV then); with in_place the paused
requests keep theirs, and SGLang fails (0.5.22+) or dies (older) on a flush refused while requests run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.engines.client import EngineError, SGLangClient
from megatron_sao.engines.protocol import (
    DELTA_BASE_INFO,
    SHARDED_BUCKET,
    WEIGHT_COMMITS_INFO,
    ServerProtocol,
    checksum_device,
)
from megatron_sao.weight_sync.sender import (
    FLATTENED,
    Boxes,
    DeltaPlan,
    GroupSpec,
    Member,
    StageSender,
    WeightSyncError,
    describe,
    failures,
    in_threads,
)

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 120.0
CHECKSUM_SKIP = ("proj", "experts", "embed", "lm_head", "mlp.gate", "indexer", "shared_expert")
"""/weights_checker skip_tensor_list when only a few norms are checked: the weights SGLang would otherwise hash too."""
"""Pause, begin, end, continue, verify calls (each engine in parallel)."""


@dataclass
class StageReport:
    """What a stage source reports to rank 0 after its buckets (small: the control path)."""

    stage: int
    error: str | None = None
    touched: list[str] = field(default_factory=list)
    broken: bool = False
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    relayed: int = 0  # of `bytes`, what relays broadcast (a shard-aware push's block groups not rooted here)
    whole: int = 0  # of `bytes`, a shard-aware push's buckets every engine rank takes whole (sent once, flattened)
    full_bytes: int = 0  # what `bytes` would have been without deltas
    delta_buckets: int = 0  # buckets that travelled as deltas
    units: int = 0  # deltas: units compared against a base (the bucket's smallest itemsize each)
    changed: int = 0  # of them, the ones that changed since the last push
    base_bytes: int = 0  # the source's bases after the push (weight_sync.delta)
    seconds: float = 0.0
    order_wait_s: float = 0.0  # waiting for the bucket before each of this stage's in the push order
    peak_bytes: int = 0
    checksums: dict[str, str] = field(default_factory=dict)  # HF name -> SGLang checksum of what was sent
    samples: dict[str, list] = field(default_factory=dict)  # HF name -> its first rows as sent (floats)
    sample_checksums: dict[str, dict[str, str]] = field(default_factory=dict)  # the same tensors' checksums as sent,
    # both of SGLang's kinds: {"cpu": sha256, "cuda": gpu_tensor_hash} (flat_bucket.sglang_checksums)
    rank_bytes: dict[str, list[int]] = field(default_factory=dict)  # url -> bytes sent to each of its ranks
    rank_checksums: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # shard-aware: url -> per rank
    # {HF name: checksum of what that rank was sent}, for the tensors it hashes as sent


class EngineSet:
    """Rank 0's view of the engines across pushes."""

    def __init__(self, cfg: WeightSyncConfig, urls: list[str], backend: str, num_stages: int, updates: int = 1) -> None:
        """`updates`: the update requests (buckets, all stages together) one push makes."""
        if not urls:
            raise ValueError("the weight sync needs at least one engine url")
        self.cfg, self.backend, self.num_stages, self.updates = cfg, backend, num_stages, updates
        self.clients = {u: SGLangClient(u, timeout_s=CONTROL_TIMEOUT_S) for u in urls}
        self.spec: GroupSpec | None = None  # the groups formed now; None: form them at the next push
        self.formed: GroupSpec | None = None  # the groups the engines may still hold (destroyed before new ones)
        self.attempt = 0
        self.quarantined: set[str] = set()  # paused because they hold a partial push
        self.held: dict[str, int] = {}  # the version each engine got from the last push that landed on it
        self._unverifiable: set[tuple[str, str]] = set()  # (url, tensor) shown neither way (logged once)
        self.unverified: list[tuple[str, str]] = []  # the last push's (url, sample) an engine showed neither way
        self.devices: dict[str, str] = {}  # url -> where it holds its weights: which hash its checksums use
        self.delta_base: int | None = None  # the version the sources' bases hold (the last push that kept them)
        self.delta: DeltaPlan | None = None  # this push's deltas
        self.commits: dict[str, int] = {}  # url -> the weight updates it had applied when the last push landed
        self.norms: dict[str, list[dict[str, str]]] = {}  # url -> what /weights_checker showed of its norms then,
        # per rank (engines that count no commits: SGLang)
        self.changed_under: list[str] = []  # engines whose weights changed since the last push without one of ours

    # ---- membership ---------------------------------------------------------------------------------------------
    def healthy(self) -> list[str]:
        ok = in_threads({u: (lambda c=c: c.health(timeout_s=5.0)) for u, c in self.clients.items()}, 15.0)
        return [u for u in self.clients if ok.get(u) is True]

    def changed(self) -> bool:
        """The engines in the groups are not the ones serving now: one died, one came back or started, or one
        restarted between two looks (it answers with its launch weights, not the version pushed to it)."""
        return self.spec is None or not self._same(self.healthy())

    def _same(self, healthy: list[str]) -> bool:
        if self.spec is None or healthy != [m.url for m in self.spec.members]:
            return False
        known = {u: v for u, v in self.held.items() if u in healthy}
        got = in_threads({u: (lambda u=u: self.clients[u].weight_version()) for u in known}, 30.0)
        restarted = [u for u, v in known.items() if got.get(u) != v]
        for u in restarted:
            log.warning("weight sync: engine %s holds version %r, not the %d pushed to it: restarted; forming the "
                        "groups again", u, got.get(u), known[u])  # fmt: skip
        return not restarted and not self._changed_under([u for u in known if u not in restarted])

    def _changed_under(self, urls: list[str]) -> list[str]:
        """The engines whose weights changed since the last push of ours landed on them: someone else pushed (under
        any version). The embedded engine and push agents count the updates they applied (/server_info
        weight_commits: exact, free); SGLang counts none, so its norms' checksums (/weights_checker, the few tensors
        every push of a whole model rewrites) are compared with what it showed when our push landed. Each is
        logged, counted in this push's sync/changed_under, and gets a whole push over groups formed again."""
        counted = [u for u in urls if u in self.commits]
        hashed = [u for u in urls if u in self.norms and u not in self.commits]
        said = in_threads({u: (lambda u=u: self.clients[u].server_info()) for u in counted}, 30.0)
        shown = in_threads({u: (lambda u=u: _norm_checksums(self.clients[u])) for u in hashed}, 120.0)
        changed = []
        for u in counted:
            now = said.get(u).get(WEIGHT_COMMITS_INFO) if isinstance(said.get(u), dict) else None
            if now is not None and now != self.commits[u]:
                log.warning("weight sync: engine %s applied %d weight update(s) since the last push of this run "
                            "landed on it: its weights changed under it; it gets a whole push", u,
                            now - self.commits[u])  # fmt: skip
                changed.append(u)
        for u in hashed:
            now = shown.get(u)
            if isinstance(now, list) and now != self.norms[u]:
                differ = sorted({n for held, was in zip(now, self.norms[u]) for n in was if held.get(n) != was[n]})
                log.warning("weight sync: engine %s shows other checksums of %s than when the last push of this run "
                            "landed on it: its weights changed under it; it gets a whole push", u,
                            ", ".join(differ[:3]) + (" ..." if len(differ) > 3 else "") or "its ranks")  # fmt: skip
                changed.append(u)
        for u in changed:
            self.commits.pop(u, None)
            self.norms.pop(u, None)
        if changed:
            self.changed_under += changed
            self.delta_base = None  # its bases may be anything now
        return changed

    def plan(self) -> tuple[GroupSpec, bool]:
        """(the groups this push uses, whether they must be formed); WeightSyncError when no engine can take it."""
        healthy = self.healthy()
        if not healthy:
            raise WeightSyncError(f"no engine answers /health ({', '.join(self.clients)})")
        if self._same(healthy):
            assert self.spec is not None
            return self.spec, False
        described, refused = [], {}
        for url in healthy:
            try:
                described.append((url, *self._describe(url)))
            except (WeightSyncError, EngineError, OSError) as e:
                refused[url] = e
        load_format = self._load_format([Member(u, p, tp, 0) for u, p, tp in described])
        members, offset = [], 1
        for url, proto, tp in described:
            shards = None
            if load_format == SHARDED_BUCKET and tp > 1:
                try:
                    shards = self._shards(url, tp)
                except (WeightSyncError, EngineError, OSError) as e:
                    refused[url] = e
                    continue
            members.append(Member(url, proto, tp, offset, shards))
            offset += tp
        for url, e in refused.items():
            log.error("weight sync: engine %s left out of the push: %s", url, e)
        if not members:
            raise WeightSyncError(f"no engine can take a weight push: {describe(refused)}")
        self.release(healthy)
        spec = GroupSpec(
            members=tuple(members), attempt=self.attempt, num_stages=self.num_stages, group_name=self.cfg.group_name,
            master_port=self.cfg.master_port, master_addr=self.cfg.master_addr, backend=self.backend,
            load_format=load_format, connect_timeout_s=self.cfg.connect_timeout_s,
            bucket_timeout_s=self.cfg.bucket_timeout_s, group_timeout_s=self.cfg.group_timeout_s,
        )  # fmt: skip
        self.attempt += 1
        self.spec = self.formed = spec
        return spec, True

    def deltas(self, spec: GroupSpec) -> DeltaPlan | None:
        """This push's deltas (weight_sync.delta), or None: every bucket whole and nothing kept. A delta is sent only
        against a version every member reports holding as its base, which is also the sources' (`delta_base`)."""
        self.delta = None
        if self.cfg.delta == "full":
            return None
        takers = spec.load_format in (FLATTENED, SHARDED_BUCKET) and all(m.protocol.deltas for m in spec.members)
        if not takers:
            if self.cfg.delta == "delta":
                old = [f"{m.url} ({'SGLang ' + m.protocol.version if not m.protocol.embedded else 'embedded'})"
                       for m in spec.members if not m.protocol.deltas]  # fmt: skip
                why = (
                    f"{old} take no deltas (SGLang takes them only through a push agent: weight_sync.agent)"
                    if old
                    else f"buckets travel {spec.load_format or 'per tensor'}, a delta needs flat buckets"
                )
                raise ValueError(f"weight_sync.delta='delta' but {why}; set weight_sync.delta to 'auto' or 'full'")
            return None
        base = self.delta_base
        if base is not None:
            said = self._each([self.clients[m.url] for m in spec.members], lambda c: c.server_info())
            held = {u: (a.get(DELTA_BASE_INFO) if isinstance(a, dict) else None) for u, a in said.items()}
            behind = {u: v for u, v in held.items() if v != base}
            if behind:
                log.info("weight sync: a full push (engines %s hold no base at version %d)",
                         ", ".join(f"{u}: {v}" for u, v in behind.items()), base)  # fmt: skip
                base = None
        self.delta = DeltaPlan(base)
        return self.delta

    def release(self, reachable: list[str] | None = None) -> None:
        """Destroy the update groups formed for an earlier push on every engine of it that still answers: SGLang
        frees an update group (its NCCL communicators on every engine GPU) only on /destroy_weights_update_group,
        so groups formed again after a membership change or a failed push would otherwise pile up on the engines
        that stay. An engine that died or restarted holds none (its answer is ignored)."""
        old, self.formed = self.formed, None
        if old is None:
            return
        names = [old.name(s) for s in range(old.num_stages)]
        stay = [self.clients[m.url] for m in old.members if reachable is None or m.url in reachable]
        self._each(stay, lambda c: [_quietly(c.destroy_weights_update_group, n) for n in names], timeout_s=60.0)

    def _describe(self, url: str) -> tuple[ServerProtocol, int]:
        """An engine's protocol and TP size; WeightSyncError naming what makes it unusable."""
        info = self.clients[url].server_info()
        try:
            proto = ServerProtocol.from_server_info(info, url)
        except ValueError as e:
            raise WeightSyncError(str(e)) from None
        self.devices[url] = checksum_device(info)
        if "tp_size" not in info:
            raise WeightSyncError(f"engine {url}: /server_info has no tp_size; cannot give it its update-group ranks")
        dp = int(info.get("dp_size") or 1)
        if dp > 1 and not info.get("enable_dp_attention"):
            raise WeightSyncError(
                f"engine {url}: --dp-size {dp} without --enable-dp-attention; SGLang refuses weight-update groups "
                "then (run one engine per replica: rollout.sglang.dp=1 and more rollout.num_engines)"
            )
        mode = self.pause_mode(proto)
        if mode == "none" and not proto.staged and self.updates > 1:
            raise ValueError(f"weight_sync.pause_mode='none': engine {url} runs SGLang {proto.version}, which loads "
                             f"each of a push's {self.updates} updates into the live model and serves requests in "
                             "between, on mixed weights under the old version; set weight_sync.pause_mode to "
                             "'in_place' (or raise weight_sync.bucket_mb until a push is one update)")  # fmt: skip
        if mode != "none" and mode not in proto.pause_modes:
            raise ValueError(f"weight_sync.pause_mode={mode!r}: engine {url} runs SGLang {proto.version}, which can "
                             f"only pause by aborting; set weight_sync.pause_mode to 'abort' or 'none', or upgrade "
                             "SGLang to >= 0.5.6")  # fmt: skip
        return proto, int(info["tp_size"])

    def pause_mode(self, proto: ServerProtocol) -> str:
        """weight_sync.pause_mode for an engine of protocol `proto` (auto resolved: none where it stages a push)."""
        if self.cfg.pause_mode != "auto":
            return self.cfg.pause_mode
        if proto.staged:
            return "none"
        return "in_place" if "in_place" in proto.pause_modes else "abort"

    def _load_format(self, members: list[Member]) -> str | None:
        """How buckets travel this push: sharded_bucket (weight_sync.transfer), flattened_bucket, or one tensor per
        broadcast (None)."""
        everyone = all(m.protocol.flattened_bucket for m in members)
        if self.cfg.load_format == "flattened_bucket" and not everyone:
            old = [f"{m.url} ({m.protocol.version})" for m in members if not m.protocol.flattened_bucket]
            raise ValueError(f"weight_sync.load_format='flattened_bucket' but {old} predate it (SGLang 0.5.6); set "
                             "weight_sync.load_format to 'auto'")  # fmt: skip
        sharded = all(m.protocol.sharded_bucket for m in members)
        if self.cfg.transfer == "sharded" and not sharded:
            full = [f"{m.url} ({m.protocol.version})" for m in members if not m.protocol.sharded_bucket]
            raise ValueError(f"weight_sync.transfer='sharded' but {full} take only full tensors (no SGLang release "
                             "receives per-rank blocks; docs/weight_sync.md 'Shard-aware pushes'); set "
                             "weight_sync.transfer to 'auto' or 'full'")  # fmt: skip
        if self.cfg.transfer == "sharded" or (self.cfg.transfer == "auto" and sharded and
                                              any(m.tp > 1 for m in members)):  # fmt: skip
            return SHARDED_BUCKET
        return FLATTENED if self.cfg.load_format != "per_tensor" and everyone else None

    def _shards(self, url: str, tp: int) -> Boxes:
        """An engine's /weight_shards, checked against its TP size; WeightSyncError naming what does not fit."""
        answer = self.clients[url].weight_shards()
        if int(answer.get("tp_size", -1)) != tp or not isinstance(answer.get("shards"), dict):
            raise WeightSyncError(f"engine {url}: /weight_shards answered for tp_size {answer.get('tp_size')!r}, "
                                  f"its /server_info says {tp}")  # fmt: skip
        table: dict[str, tuple[Any, ...]] = {}
        for name, boxes in answer["shards"].items():
            if not isinstance(boxes, list) or len(boxes) != tp:
                raise WeightSyncError(f"engine {url}: /weight_shards lists {name} for {len(boxes)} ranks, not {tp}")
            table[name] = tuple(None if b is None else (tuple(b[0]), tuple(b[1])) for b in boxes)
        return table

    # ---- the session around a push ------------------------------------------------------------------------------
    def open(self, spec: GroupSpec) -> str | None:
        """Pause and begin on every member; the error (after undoing it) or None."""
        modes = {m.url: self.pause_mode(m.protocol) for m in spec.members}
        paused = [self.clients[m.url] for m in spec.members if modes[m.url] != "none"]
        failed = failures(self._each(paused, lambda c: c.pause_generation(modes[c.url])))
        if failed:
            return f"pause_generation failed: {describe(failed)}"
        failed = failures(self._each([self.clients[m.url] for m in spec.members if m.protocol.session], _begin))
        if failed:
            return f"begin_weight_update failed: {describe(failed)}"
        return None

    def finish(self, spec: GroupSpec, version: int, marker: StageSender, reports: list[StageReport],
               tied_lm_head: bool) -> dict[str, Any]:  # fmt: skip
        """Every stage landed: mark, end, verify, continue. {url: why it failed} for the engines that failed."""
        flush = {m.url: self.cfg.flush_cache and self.pause_mode(m.protocol) in ("abort", "retract")
                 for m in spec.members}  # fmt: skip
        bad: dict[str, str] = {}
        for url, answer in failures(marker.send_marker(version, flush)).items():
            bad[url] = f"marker update: {describe({url: answer})}"
        sessions = [self.clients[m.url] for m in spec.members if m.protocol.session and m.url not in bad]
        for url, answer in failures(self._each(sessions, lambda c: c.end_weight_update(), timeout_s=600.0)).items():
            bad[url] = f"end_weight_update: {describe({url: answer})}"
        for url, why in self._verify(spec, reports, tied_lm_head, skip=set(bad)).items():
            bad[url] = f"verify: {why}"
        return bad

    def conclude(self, spec: GroupSpec, bad: dict[str, str], touched: set[str], version: int | None = None) -> None:
        """Continue the engines that may serve; keep paused the ones holding part of a push (`bad` and touched)."""
        for m in spec.members:
            if version is not None and m.url not in bad:
                self.held[m.url] = version
            elif m.url in bad:
                self.held.pop(m.url, None)
            self.commits.pop(m.url, None)
            self.norms.pop(m.url, None)
        if version is not None:  # what each engine that took this push holds, to see later pushes not ours
            landed = [m for m in spec.members if m.url not in bad]
            said = self._each([self.clients[m.url] for m in landed if m.protocol.embedded], lambda c: c.server_info())
            for url, answer in said.items():
                if isinstance(answer, dict) and isinstance(answer.get(WEIGHT_COMMITS_INFO), int):
                    self.commits[url] = answer[WEIGHT_COMMITS_INFO]
            hashed = [self.clients[m.url] for m in landed if m.url not in self.commits and m.protocol.weights_checker]
            for url, answer in self._each(hashed, _norm_checksums).items():
                if isinstance(answer, list) and any(answer):
                    self.norms[url] = answer
        # the sources' bases move to this version only when it landed on every engine (sync.py settles them alike)
        self.delta_base = version if self.delta is not None and version is not None and not bad else None
        staged = {m.url for m in spec.members if m.protocol.staged}
        hold = {u for u in bad if u in touched and (u not in staged or bad[u].startswith("verify"))}
        # only a complete push that landed lifts a quarantine: a later push that failed before touching an engine
        # (a connect or open failure) leaves its partial weights exactly as they were
        landed = {m.url for m in spec.members if version is not None and m.url not in bad}
        self.quarantined = (self.quarantined | hold) - landed
        unpaused = {m.url for m in spec.members if self.pause_mode(m.protocol) == "none"}
        go = [self.clients[m.url] for m in spec.members if m.url not in self.quarantined and m.url not in unpaused]
        for url, e in failures(self._each(go, lambda c: c.continue_generation())).items():
            log.warning("weight sync: continue_generation on %s failed: %s", url, describe({url: e}))
        if hold & unpaused:
            self._each([self.clients[u] for u in hold & unpaused], lambda c: c.pause_generation("abort"))
        for url in sorted(hold):
            log.error("weight sync: engine %s holds a partial push and stays paused until a complete one lands (%s)",
                      url, bad[url])  # fmt: skip
        if bad:
            self.spec = None  # form the groups again at the next push

    def abandon(self, spec: GroupSpec, reason: str, touched: set[str]) -> None:
        """A stage failed: every engine drops the groups and its session; see the module docstring."""
        self.formed, self.unverified = spec, []  # nothing of this push is verified: it is not live anywhere
        self.release()
        self._each([self.clients[m.url] for m in spec.members if m.protocol.session],
                   lambda c: _quietly(c.end_weight_update), timeout_s=600.0)  # fmt: skip
        self.conclude(spec, {m.url: reason for m in spec.members}, touched)

    def close(self) -> None:
        self.release()
        self.spec = None

    # ---- verification -------------------------------------------------------------------------------------------
    def _verify(self, spec: GroupSpec, reports: list[StageReport], tied: bool, skip: set[str]) -> dict[str, str]:
        """{url: what differs} for engines whose weights are not what was sent (weight_sync.verify)."""
        mode = self.cfg.verify
        self.unverified = []
        if mode == "none":
            return {}
        sent = {k: v for r in reports for k, v in r.checksums.items()}
        samples = [
            (r.stage, name, rows, r.sample_checksums.get(name)) for r in reports for name, rows in r.samples.items()
        ]
        todo = [m for m in spec.members if m.url not in skip]
        calls: dict[str, Callable[[], Any]] = {}
        for m in todo:
            c = self.clients[m.url]
            # an embedded engine on one rank holds every tensor whole: all of them are compared; at TP > 1 its ranks
            # hash their own slices, as SGLang's do, so the stages' samples (replicated norms) are compared per rank
            per_rank = [{k: v for r in reports for k, v in r.rank_checksums.get(m.url, [{}] * m.tp)[i].items()}
                        for i in range(m.tp)]  # fmt: skip
            if m.shards is not None and m.protocol.weights_checker and mode in ("auto", "checksum") and any(per_rank):
                calls[m.url] = lambda c=c, p=per_rank: _compare_rank_checksums(c, p)
            elif (
                m.protocol.embedded
                and m.tp == 1
                and m.protocol.weights_checker
                and mode in ("auto", "checksum")
                and sent
            ):
                calls[m.url] = lambda c=c: _compare_checksums(c, sent, ["lm_head.weight"] if tied else [])
            else:
                calls[m.url] = lambda c=c, m=m: self._compare_samples(c, m, samples)
        results = in_threads(calls, 600.0)
        return {u: (repr(v) if isinstance(v, BaseException) else v) for u, v in results.items() if v}

    def _compare_samples(self, client: SGLangClient, member: Member,
                         samples: list[tuple[int, str, list, dict[str, str] | None]]) -> str | None:  # fmt: skip
        """Check every stage's samples on one engine: by checksum on each of its ranks where /weights_checker
        shows the tensor (SGLang >= 0.5.6; the hash SGLang applies where the engine holds its weights: its Triton
        kernel's on a GPU), else by its first rows (/get_weights_by_name, which SGLang serves only for some model
        classes, not Qwen3-MoE or GLM). A sample the engine can show neither way -- no checker row for it and no
        rows -- is unverified: counted (sync/unverified), logged once, never a reason to take the engine out."""
        url = member.url
        device = self.devices.get(url) or ("cpu" if member.protocol.embedded else "cuda")
        held: list[dict[str, str]] = []
        if member.protocol.weights_checker:
            names = [name for _, name, _, _ in samples]
            skip = [p for p in CHECKSUM_SKIP if not any(p in n for n in names)]  # hash the norms, not the model
            try:
                held = [r.get("checksums", {}) for r in client.weights_checksum(skip).get("ranks", [])]
            except (EngineError, OSError, AttributeError) as e:
                log.warning("weight sync: %s /weights_checker failed (%s); checking rows instead", url, e)
        for stage, name, rows, sums in samples:
            checksum = None if sums is None else sums.get(device)
            ranks = [i for i, h in enumerate(held) if name in h]
            wrong: list[int] = []
            if ranks and checksum is not None:
                wrong = [i for i in ranks if held[i][name] != checksum]
                if not wrong:
                    continue
            # no checksum shown, or one that differs (a tensor SGLang holds sliced or in another dtype): the rows
            try:
                got = client.get_weights_by_name(name, truncate_size=len(rows))
            except EngineError as e:
                got, why = None, str(e)
            else:
                why = "it answered null"
            if got is None:
                if wrong:
                    return f"stage {stage}: {name} differs from what was sent on engine rank(s) {wrong}"
                self.unverified.append((url, name))  # (list.append: safe from the verifying threads)
                if (url, name) not in self._unverifiable:
                    log.warning("weight sync: %s shows stage %d's %s neither by checksum nor by rows (%s); that "
                                "stage's part of its pushes is not verified", url, stage, name, why)  # fmt: skip
                    self._unverifiable.add((url, name))
                continue
            if not torch.equal(torch.tensor(got, dtype=torch.float32), torch.tensor(rows, dtype=torch.float32)):
                return f"stage {stage}: {name}: the engine's first rows differ from what was sent"
        return None

    @staticmethod
    def _each(clients: list[SGLangClient], fn: Callable[[SGLangClient], Any], timeout_s: float = CONTROL_TIMEOUT_S
              ) -> dict[str, Any]:  # fmt: skip
        return in_threads({c.url: (lambda c=c: fn(c)) for c in clients}, timeout_s)


def _begin(client: SGLangClient) -> Any:
    """begin_weight_update; a session left open by a trainer that went away is closed first (SGLang refuses a
    second begin)."""
    try:
        return client.begin_weight_update()
    except EngineError as e:
        if "already open" not in str(e):
            raise
    log.warning("weight sync: %s had a weight-update session open (a previous push was cut); closing it", client.url)
    _quietly(client.end_weight_update)
    return client.begin_weight_update()


def _norm_checksums(client: SGLangClient) -> list[dict[str, str]]:
    """Per rank, /weights_checker's checksums of the engine's norms (every other weight skipped: SGLang hashes only
    what it is not told to skip, so this stays a few kilobytes of hashing however large the model)."""
    return [r.get("checksums", {}) for r in client.weights_checksum(list(CHECKSUM_SKIP)).get("ranks", [])]


def _compare_checksums(client: SGLangClient, sent: dict[str, str], skip: list[str]) -> str | None:
    answer = client.weights_checksum(skip)
    held = answer["ranks"][0]["checksums"]
    wrong = sorted(n for n, chk in sent.items() if held.get(n) != chk)
    if wrong:
        more = ", ..." if len(wrong) > 4 else ""
        return f"{len(wrong)} tensors differ from what was sent ({', '.join(wrong[:4])}{more})"
    return None


def _compare_rank_checksums(client: SGLangClient, sent: list[dict[str, str]]) -> str | None:
    """A shard-aware push: every engine rank holds exactly the blocks (and whole tensors) it was sent."""
    ranks = client.weights_checksum([]).get("ranks", [])
    if len(ranks) != len(sent):
        return f"/weights_checker shows {len(ranks)} ranks, {len(sent)} were sent to"
    for i, (held, mine) in enumerate(zip((r.get("checksums", {}) for r in ranks), sent)):
        wrong = sorted(n for n, chk in mine.items() if held.get(n) != chk)
        if wrong:
            more = ", ..." if len(wrong) > 4 else ""
            return f"rank {i}: {len(wrong)} tensors differ from what was sent ({', '.join(wrong[:4])}{more})"
    return None


def _quietly(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except (EngineError, OSError) as e:
        return e
