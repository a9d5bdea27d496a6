"""The weight push, as every learner rank takes part in it (owned by weight_sync/; run/learn.py calls push()).

    WeightSync(model, spec, ...)      collective, once: every rank tells the others which main-replica shards it
                                      holds (one object gather: the control path), every rank computes the same
                                      TransferPlan (plan.py) and creates the same gather groups (one per distinct
                                      set of holders in a stage, all inside that stage).
    push(version)                     collective, per version:
      1. rank 0 picks the engines (engines.py plan()): the ones answering /health, with their protocols;
      2. when that set changed or the last push failed, the update groups are formed, stage after stage (an
         engine's scheduler joins one group at a time: stages forming at once could deadlock two engines);
      3. rank 0 pauses the engines and begins their sessions;
      4. every stage at once: its ranks gather bucket after bucket to the stage source (gather.py), which sends
         each to the engines over the stage's own group (sender.py), bucket k+1 gathered while k travels; ranks
         that are not sources are done once their gathers are;
      5. the sources report to rank 0, which ends the push (marker, end, verify, continue) or abandons it
         (engines.py), and tells the sources whether their groups live on.
A push that fails anywhere fails as a whole and is retried at the next step; training goes on. On a rank that is no
source push() returns {} (run/learn.py shares rank 0's metrics).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.distributed import flat_bucket
from megatron_sao.distributed.bootstrap import DistContext
from megatron_sao.distributed.update_group import block_group_name
from megatron_sao.engines.protocol import SHARDED_BUCKET
from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.fp8 import Fp8Format
from megatron_sao.models.weights import weight_mapping
from megatron_sao.weight_sync.engines import EngineSet, StageReport
from megatron_sao.weight_sync.gather import MemoryMeter, StageGather, collect, hf_views, local_pieces, rank_info
from megatron_sao.weight_sync.plan import Bucket, TransferPlan, build_plan
from megatron_sao.weight_sync.relay import Relay, cancel_key
from megatron_sao.weight_sync.sender import Bases, DeltaPlan, GroupSpec, Hosted, PushOrder, StageSender, WeightSyncError

log = logging.getLogger(__name__)

_PUSH_IDS = itertools.count(1)
"""Every push of this process, whichever WeightSync makes it, takes the next id: every rank makes the same pushes in
the same order, so the ids agree across ranks, and no push reads another's keys in the learner's store (two syncs
that each counted from 1 shared their push order's keys, and the second's stages ran out of order)."""

SAMPLE_ROWS = 8
"""Rows of each weight_sync.verify_tensors tensor kept to compare with what the engines show."""


def stage_samples(stage_names: list[str], configured: list[str]) -> list[str]:
    """The tensors of one stage checked on engines that cannot show every checksum (SGLang): the configured
    `weight_sync.verify_tensors` this stage sends, and the stage's first norm weight (1-D, kept unfused and unsharded
    by SGLang under its HF name), so every stage's part of a push is checked before the version is live."""
    mine = [n for n in configured if n in stage_names]
    norm = next((n for n in stage_names if n.endswith("norm.weight") and n not in mine), None)
    return mine + ([norm] if norm is not None else [])


def engine_rank_bytes(reports: list[StageReport]) -> list[int]:
    """What each engine rank received in one push, over all stages (a full push: every bucket, on every rank)."""
    total: dict[tuple[str, int], int] = {}
    for r in reports:
        for url, per_rank in r.rank_bytes.items():
            for i, n in enumerate(per_rank):
                total[(url, i)] = total.get((url, i), 0) + n
    return list(total.values())


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def hf_dtype_of(hf_source: dict[str, Any] | None, fallback: torch.dtype) -> Callable[[str], torch.dtype]:
    """HF dtype of each tensor from the learner's hf_source record (the dtypes the engines loaded), else
    `fallback` (a model not loaded from HF)."""
    if not hf_source:
        return lambda name: fallback
    default = getattr(torch, hf_source["hf_dtype"])
    exceptions = {n: getattr(torch, d) for n, d in hf_source.get("hf_dtype_exceptions", {}).items()}
    return lambda name: exceptions.get(name, default)


class WeightSync:
    def __init__(
        self,
        model: Any,
        spec: ModelSpec,
        dtype_of: Callable[[str], torch.dtype],
        cfg: WeightSyncConfig,
        engine_urls: list[str],
        *,
        layout: DistContext,
        fp8_format: Fp8Format | None = None,
    ) -> None:
        """`layout`: the learner's DistContext (its rank and pipeline stage). `fp8_format`: the engines serve a
        block-FP8 checkpoint (models/fp8.py checkpoint_format of what they load): its weights are quantized into that
        format before they travel."""
        self.cfg, self.spec, self.layout = cfg, spec, layout
        self.rank = layout.rank
        self.backend = resolve_backend(cfg.backend)
        self.control, self.plan, self.gather = prepare(
            model, spec, dtype_of, cfg.bucket_bytes, layout, gloo_sends=self.backend != "nccl", fp8_format=fp8_format
        )
        self.stage = self.gather.stage
        self.sources_group = dist.new_group(self.plan.sources, backend="gloo")
        # a shard-aware push's relays: a pair group {source, relay} for each rank on a stage source's host (relay.py)
        pair_backend = "gloo" if self.gather.send_device.type == "cpu" else "nccl"
        self.pairs = {r: dist.new_group([st.source, r], backend=pair_backend)
                      for st in self.plan.stages for r in st.relays if r != st.source}  # fmt: skip
        self.relay: Relay | None = None
        updates = sum(len(st.buckets) for st in self.plan.stages)
        self.engines: EngineSet | None = None
        if self.rank == 0:
            self.engines = EngineSet(cfg, engine_urls, self.backend, len(self.plan.stages), updates)
        self.sender: StageSender | None = None
        self.peak_bytes = 0  # this rank's largest push so far (MemoryMeter)
        self.pushes = 0  # pushes begun by this sync
        self.push_id = 0  # the latest push's id, the same on every rank (names its keys in the store: _PUSH_IDS)
        self.order: PushOrder | None = None  # the last push's order across stages (its keys go at the next)
        # deltas: a stage source's bases, what it last sent per channel (weight_sync.delta; None until a push keeps)
        self.bases: Bases | None = None

    @property
    def is_source(self) -> bool:
        return self.rank == self.stage.source

    # ---- one push -----------------------------------------------------------------------------------------------
    def push(self, version: int) -> dict[str, float]:
        """Collective over the learner's world: put `version`'s weights on the engines; rank 0's metrics."""
        t0 = time.monotonic()
        self.pushes += 1
        self.push_id = next(_PUSH_IDS)
        decision: Any = None
        if self.engines is not None:
            try:
                spec, reform = self.engines.plan()
                decision = spec, reform, self.engines.deltas(spec)
            except WeightSyncError as e:
                decision = str(e)
        decision = self._bcast(decision, 0)
        if isinstance(decision, str):
            if self.rank == 0:
                log.error("weight sync to the engines at version %d: %s", version, decision)
            return {"sync/failed": 1.0, "sync/version": float(version)}
        spec, reform, delta = decision
        phases = {"plan": time.monotonic() - t0}
        t = time.monotonic()
        if reform and not self._connect(spec):
            return self._failed(version, t0)
        phases["connect"] = time.monotonic() - t
        t = time.monotonic()
        error = self.engines.open(spec) if self.engines is not None else None
        if self._bcast(error, 0) is not None:
            if self.engines is not None:
                log.error("weight sync at version %d: %s", version, error)
                self.engines.abandon(spec, str(error), touched=set())
            self._drop_sender()
            return self._failed(version, t0)
        phases["open"] = time.monotonic() - t
        t = time.monotonic()
        report = self._transfer(spec, delta)
        if not self.is_source:
            return {}
        reports: list[Any] = [None] * len(self.plan.sources) if self.rank == 0 else []
        dist.gather_object(report, reports if self.rank == 0 else None, dst=0, group=self.sources_group)
        phases["transfer"] = time.monotonic() - t
        t = time.monotonic()
        metrics = self._conclude(spec, version, reports, t0) if self.rank == 0 else {}
        if metrics:
            phases["finish"] = time.monotonic() - t
            metrics.update({f"sync/time_{k}": v for k, v in phases.items()})
        keep = [not metrics.get("sync/failed")]
        dist.broadcast_object_list(keep, src=0, group=self.sources_group)
        if self.bases is not None:  # what this push sent becomes the bases where it landed everywhere
            self.bases.settle(version if keep[0] and delta is not None else None)
        if not keep[0]:
            self._drop_sender()
        return metrics

    def engines_changed(self) -> bool:
        """Collective: whether the engines answering /health differ from the ones in the groups (rank 0 asks)."""
        return bool(self._bcast(self.engines.changed() if self.engines is not None else None, 0))

    def close(self) -> None:
        self._drop_sender()
        if self.engines is not None:
            self.engines.close()

    # ---- the steps ----------------------------------------------------------------------------------------------
    def _connect(self, spec: GroupSpec) -> bool:
        """Form the stages' update groups one after the other; False (everything undone) when one failed. A
        shard-aware push's block groups are rooted at the stage's relays (relay.py), which join them meanwhile."""
        self._drop_sender()
        parts = spec.block_groups or []
        for st in self.plan.stages:
            roots = [st.relay_of(i, len(parts)) for i in range(len(parts))]
            hosted: Hosted | str | None = None
            if self.rank == st.source:
                try:
                    hosted = StageSender.host(st.stage, spec)
                except WeightSyncError as e:
                    hosted = str(e)
            mine_hosted = (hosted.address, hosted.port) if isinstance(hosted, Hosted) else hosted
            where = self._bcast(mine_hosted, st.source)
            error = where if isinstance(where, str) else None
            if error is None and self.rank == st.source:
                assert isinstance(hosted, Hosted)
                relays = sorted(set(roots) - {st.source})
                links = {r: (self.pairs[r], [i for i, x in enumerate(roots) if x == r]) for r in relays}
                try:
                    self.sender = StageSender.connect(st.stage, spec, hosted,
                                                      own=[i for i, x in enumerate(roots) if x == st.source],
                                                      links=links)  # fmt: skip
                except (WeightSyncError, ValueError) as e:
                    error = str(e)
            elif error is None and self.rank in roots:
                mine = [i for i, x in enumerate(roots) if x == self.rank]
                name = spec.name(st.stage)
                try:
                    self.relay = Relay.join(st.stage, st.source, self.pairs[self.rank], mine,
                                            [block_group_name(name, i) for i in mine],
                                            [len(parts[i]) + 1 for i in mine], where[0], where[1], spec.backend,
                                            self.gather.send_device, spec.connect_timeout_s, spec.bucket_timeout_s,
                                            spec.group_timeout_s)  # fmt: skip
                except (RuntimeError, ValueError) as e:
                    error = f"stage {st.stage} relay rank {self.rank}: could not join its block groups: {e}"
            errors: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(errors, error, group=self.control)
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                self._drop_sender()
                if self.engines is not None:
                    log.error("weight sync: %s", error)
                    self.engines.abandon(spec, error, touched=set())
                return False
        return True

    def _transfer(self, spec: GroupSpec, delta: DeltaPlan | None) -> StageReport:
        report = StageReport(self.stage.stage)
        t0 = time.monotonic()
        self.gather.meter = MemoryMeter()
        checksums = self.cfg.verify in ("auto", "checksum") and any(m.protocol.embedded for m in spec.members)
        sharded = spec.load_format == SHARDED_BUCKET
        # whole-tensor checksums only where an engine compares them (an embedded engine on one rank, full push):
        # hashing the model is a pass over every byte on the push's path; a shard-aware push hashes what each rank got
        whole = checksums and not sharded and any(m.protocol.embedded and m.tp == 1 for m in spec.members)
        samples = (
            set(stage_samples(self.stage.hf_names, self.cfg.verify_tensors)) if self.cfg.verify != "none" else set()
        )

        def on_packed(bucket: Bucket, buffer: torch.Tensor) -> None:
            for name, view in hf_views(bucket, buffer):
                if whole:
                    report.checksums[name] = flat_bucket.tensor_checksum(view)
                if name in samples:
                    report.samples[name] = view[:SAMPLE_ROWS].float().cpu().tolist()
                    report.sample_checksums[name] = flat_bucket.sglang_checksums(view)

        sender = self.sender
        if sender is not None:
            if delta is not None and self.bases is None:
                self.bases = Bases()
            if self.bases is not None:
                self.bases.pending.clear()
            sender.delta, sender.bases = delta, self.bases
            sender.meter = self.gather.meter
            sender.rank_checksums = {} if checksums and sharded else None
            sender.rank_bytes = {m.url: [0] * m.tp for m in spec.members}
            if self.order is not None:
                self.order.cleanup()
            counts = [len(st.buckets) for st in self.plan.stages]
            self.order = sender.order = PushOrder(counts, self.stage.stage, self.push_id, self.cfg.bucket_timeout_s)
        if self.relay is not None:
            self.relay.start(self.push_id)
        try:
            self.gather.run(sender.start if sender is not None else None, on_packed if sender is not None else None)
        except WeightSyncError as e:
            report.error = str(e)
        except BaseException as e:  # a collective of the gathers failed: stop the later stages now, then raise
            if sender is not None and sender.order is not None:
                sender.order.finish(f"stage {self.stage.stage} failed: {e!r}")
            raise
        finally:
            if sender is not None and sender.links:
                self._stop_relays(sender, failed=report.error is not None)
            if self.relay is not None:
                self.relay.finish()
        if sender is not None and sender.order is not None:
            sender.order.finish(report.error)
            report.order_wait_s = sender.order.waited_s
        if sender is not None and sender.broken:
            # a peer is known dead (or never received): abort the group now, before reporting to rank 0 and before
            # its abandon calls to the engines (minutes at worst), so torch's NCCL watchdog never sees the group's
            # pending work reach the collective timeout
            sender.close()
        self.peak_bytes = max(self.peak_bytes, self.gather.meter.peak)
        report.peak_bytes, report.seconds = self.gather.meter.peak, time.monotonic() - t0
        if sender is not None:
            report.touched, report.broken = sorted(sender.touched), sender.broken
            for k, v in sender.stats.items():  # buckets, tensors, bytes, relayed, whole, full_bytes, ...
                setattr(report, k, v)
            report.base_bytes = self.bases.nbytes if self.bases is not None else 0
            report.rank_bytes, report.rank_checksums = sender.rank_bytes, sender.rank_checksums or {}
            sender.touched.clear()
            sender.stats = dict.fromkeys(sender.stats, 0)
        return report

    def _conclude(self, spec: GroupSpec, version: int, reports: list[StageReport], t0: float) -> dict[str, float]:
        assert self.engines is not None and self.sender is not None
        errors = [f"stage {r.stage}: {r.error}" for r in reports if r.error]
        touched = {u for r in reports for u in r.touched}
        if errors:
            bad = {m.url: "; ".join(errors) for m in spec.members}
            self.engines.abandon(spec, "; ".join(errors), touched)
        else:
            bad = self.engines.finish(spec, version, self.sender, reports, self.spec.tie_embeddings)
            self.engines.conclude(spec, bad, touched, version)
        if bad:
            log.error("weight sync at version %d failed on %d of %d engines: %s", version, len(bad),
                      len(spec.members), "; ".join(f"{u}: {w}" for u, w in bad.items()))  # fmt: skip
        changed_under, self.engines.changed_under = self.engines.changed_under, []
        return {
            "sync/seconds": time.monotonic() - t0,
            "sync/version": float(version),
            "sync/stages": float(len(reports)),
            "sync/engines": float(len(spec.members) - len(bad)),
            "sync/failed_engines": float(len(bad)),
            "sync/unverified": float(len(self.engines.unverified)),
            "sync/quarantined": float(len(self.engines.quarantined)),
            "sync/changed_under": float(len(changed_under)),  # engines whose weights a push not ours changed
            "sync/buckets": float(sum(r.buckets for r in reports)),
            "sync/tensors": float(sum(r.tensors for r in reports)),
            "sync/bytes": float(sum(r.bytes for r in reports)),
            "sync/bytes_full": float(sum(r.full_bytes for r in reports)),  # what the same push sent whole
            "sync/delta_buckets": float(sum(r.delta_buckets for r in reports)),
            # of the units compared against a base, the share that changed since the last push (the change density)
            "sync/delta_density": sum(r.changed for r in reports) / max(1, sum(r.units for r in reports)),
            "sync/delta_base_mb": max(r.base_bytes for r in reports) / 2**20,  # a source's bases (weight_sync.delta)
            "sync/relayed_bytes": float(sum(r.relayed for r in reports)),
            "sync/whole_bytes": float(sum(r.whole for r in reports)),  # shard-aware: buckets every rank takes whole
            "sync/stage_seconds_max": max(r.seconds for r in reports),
            "sync/order_wait_max": max(r.order_wait_s for r in reports),
            "sync/peak_mb": max(r.peak_bytes for r in reports) / 2**20,
            "sync/flattened": float(spec.load_format is not None),
            "sync/sharded": float(spec.load_format == SHARDED_BUCKET),
            "sync/engine_rank_mb_max": max(engine_rank_bytes(reports), default=0) / 2**20,
            "sync/failed": float(bool(bad)),
        }

    def _stop_relays(self, sender: StageSender, failed: bool) -> None:
        """End the push on this stage's relays; when it failed, tell them first (a bucket an engine refused never
        lands: its relay stops waiting for it)."""
        from torch.distributed.distributed_c10d import _get_default_store

        key = cancel_key(self.push_id, self.stage.stage)
        if failed:
            _get_default_store().set(key, "1")
        sender.stop_relays()
        if failed:
            _get_default_store().delete_key(key)

    def _failed(self, version: int, t0: float) -> dict[str, float]:
        return {"sync/failed": 1.0, "sync/version": float(version), "sync/seconds": time.monotonic() - t0}

    def _drop_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()

    def _bcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]


def prepare(
    model: Any,
    spec: ModelSpec,
    dtype_of: Callable[[str], torch.dtype],
    bucket_bytes: int,
    layout: DistContext,
    gloo_sends: bool,
    fp8_format: Fp8Format | None = None,
) -> tuple[Any, TransferPlan, StageGather]:
    """Collective: (the gloo control group, the plan every rank computed, this rank's StageGather). Every rank tells
    the others its pieces (one object gather), then creates every gather group in the plan's order. `layout`: the
    learner's DistContext (this rank, its pipeline stage, the world)."""
    rank = layout.rank
    control = dist.new_group(backend="gloo")  # small objects only: plan metadata, decisions, reports
    pieces = local_pieces(model, rank)
    infos: list[Any] = [None] * layout.world_size
    dist.all_gather_object(infos, rank_info(pieces, rank, layout.pp_rank), group=control)
    mapping = weight_mapping(spec)
    plan = build_plan(infos, mapping, dtype_of, bucket_bytes, fp8_format)
    device = pieces[0][1].device if pieces else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    groups = {m: dist.new_group(list(m), backend=backend) for m in plan.gather_groups}  # same order on every rank
    send_device = torch.device("cpu") if gloo_sends else device
    gather = StageGather(plan.stage_of(rank), rank, pieces, groups, mapping, device, send_device, fp8_format)
    return control, plan, gather


def gather_hf_tensors(
    model: Any,
    spec: ModelSpec,
    dtype_of: Callable[[str], torch.dtype],
    bucket_bytes: int,
    *,
    layout: DistContext,
    fp8_format: Fp8Format | None = None,
) -> tuple[dict[str, torch.Tensor], TransferPlan, int]:
    """Collective, no engines: run every stage's gathers and keep what each source would send. Returns (this rank's
    {HF name: tensor} -- its stage's tensors on a source, {} elsewhere --, the plan, this rank's peak extra bytes).
    For tests, tools and benchmarks: the same plan and gathers as a push. `layout`: the learner's DistContext."""
    _, plan, gather = prepare(model, spec, dtype_of, bucket_bytes, layout, gloo_sends=True, fp8_format=fp8_format)
    out = collect(gather)
    return out, plan, gather.meter.peak
