"""`weight_sync` section: resharding the learner's weights and broadcasting them to the engines (weight_sync/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section

GROUP_TIMEOUT_MARGIN_S = 60.0
"""group_timeout_s exceeds bucket_timeout_s by at least this: the refusal grace and the abort itself fit in it."""


class WeightSyncConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Backend of the update groups with the engines. auto: nccl when CUDA is available, else gloo."""

    interval: int = Field(default=1, ge=1)
    """Push weights to the engines every `interval` policy steps (and whenever an engine joined, or a push failed)."""

    bucket_mb: float = Field(default=512, gt=0)
    """Per bucket, what a stage source receives from its gather group and what it sends stay within this many MB
    (a larger single tensor travels alone); a push holds about two buckets plus the largest tensor per rank."""

    master_addr: str = "auto"
    """Address each stage source hosts its update group at. auto: the source's own address towards the engines
    (loopback when every engine is on loopback). A loopback address is refused when an engine is remote."""

    master_port: int = Field(default=29700, ge=1024, le=65535)
    """Stage p's group listens on master_port + p (+ num_stages x attempt after a failed push)."""

    group_name: str = "sao_weight_sync"
    """Prefix of the update groups' names (<group_name>_pp<stage>_a<attempt>)."""

    load_format: Literal["auto", "flattened_bucket", "per_tensor"] = "auto"
    """auto: each bucket as one flat buffer and one broadcast when every engine understands it (SGLang >= 0.5.6),
    else one broadcast per tensor; flattened_bucket: refuse engines that do not; per_tensor: always per tensor."""

    transfer: Literal["auto", "full", "sharded"] = "auto"
    """What each engine rank receives. full: every tensor whole, one broadcast to all ranks (what SGLang's ranks
    take); sharded: only its block of each tensor it holds split plus the replicated ones whole, one broadcast per
    set of ranks holding the same blocks
    (load_format "sharded_bucket": the embedded engine, whose /weight_shards says the blocks); auto: sharded when
    every engine takes it and one runs at TP > 1, else full (docs/weight_sync.md, "Shard-aware pushes")."""

    flush_cache: bool = True
    """Flush the engines' prefix cache after a push. Asked only of engines paused by abort or retract: with in_place
    the paused requests keep their KV, and SGLang refuses a flush then (0.5.22+ fails the update, older servers die);
    unpaused (none) they run on."""

    pause_mode: Literal["auto", "in_place", "abort", "retract", "none"] = "auto"
    """How engines pause during a push: in_place keeps requests and their KV (tokens after the push carry the new
    version), retract requeues them, abort ends them, none keeps generating (the embedded engine stages the push and
    switches at one step). none is refused for SGLang engines when a push is more than one update (buckets over
    all stages): SGLang loads each into the live model and serves requests between them, on mixed weights. auto,
    per engine: none where it stages a push (the embedded engine from SGLang 0.5.21's sessions on), else in_place
    (abort on SGLang before 0.5.6, which can do nothing else)."""

    verify: Literal["auto", "checksum", "sample", "none"] = "auto"
    """Check what the engines hold after a push before it is live: checksum compares every tensor's checksum
    (/weights_checker) with what was sent (the embedded engine; auto uses it there); sample compares the first rows
    of `verify_tensors` (/get_weights_by_name; auto uses it for SGLang). An engine that differs stays paused."""

    verify_tensors: list[str] = Field(default_factory=lambda: ["model.norm.weight"])
    """HF names sampled by the `sample` check (tensors SGLang keeps unfused)."""

    agent: bool = False
    """Push through a push agent beside each engine (engines/agent/, `python -m megatron_sao agent`): its ranks receive
    each engine rank's slice while the engine keeps generating, then hand it over by /update_weights_from_tensor
    (SGLang >= 0.5.21), so an engine stops only for the handover. The launchers start one per engine at the
    engine's port + agent_port_offset; for engines you run (rollout.engine_urls) start them there yourself. Off:
    pushes go to the engines themselves (full tensors to SGLang; the embedded engine takes sharded ones anyway)."""

    agent_port_offset: int = Field(default=1000, ge=1, le=30000)
    """An engine's push agent listens on the engine's port + this (on the engine's host)."""

    agent_part_mb: float = Field(default=512, gt=0)
    """Bytes per engine rank in one handover call of an agent (on GPUs, the device copy it lends at a time)."""

    delta: Literal["full", "delta", "auto"] = "full"
    """Push only what changed (docs/weight_sync.md, "Deltas"). full: every bucket whole. delta: each stage source keeps
    what it last sent (a copy of its stage in the engines' dtype: `plan` counts it) and sends each bucket as the
    smallest of its changes and its bytes, against the version every engine reports holding as its base, whole to
    any engine that lacks it; every engine must take deltas (the embedded engine, or SGLang through a push agent:
    weight_sync.agent), and each keeps the same copy on its host. auto: delta where every engine takes them, else
    full. Pays at the paper's learning rates (1e-6: ~1% of bf16 elements change per step); at the CPU examples' (3e-3,
    5e-4) most of every bucket changes and buckets go whole."""

    connect_timeout_s: float = Field(default=300.0, gt=0)
    """Forming one stage's update group (every engine rank joins)."""

    bucket_timeout_s: float = Field(default=300.0, gt=0)
    """One bucket reaching every engine; past it the group is aborted, the push fails and is retried later."""

    group_timeout_s: float = Field(default=1800.0, gt=0)
    """The update groups' collective timeout on the learner (what torch's NCCL watchdog enforces). It must exceed
    bucket_timeout_s with room to spare: a source aborts its group as soon as a bucket failed or timed out, and that
    abort has to come before the watchdog would end the learner (docs/weight_sync.md, "A dead engine mid-push")."""

    @model_validator(mode="after")
    def _check(self) -> WeightSyncConfig:
        if self.group_timeout_s < self.bucket_timeout_s + GROUP_TIMEOUT_MARGIN_S:
            raise ValueError(
                f"weight_sync.group_timeout_s={self.group_timeout_s:g} must be at least weight_sync.bucket_timeout_s "
                f"({self.bucket_timeout_s:g}) + {GROUP_TIMEOUT_MARGIN_S:g}: a failed bucket is detected at "
                "bucket_timeout_s and its group aborted then, before the collective timeout would end the learner; "
                "raise group_timeout_s or lower bucket_timeout_s"
            )
        if self.delta == "delta" and self.load_format == "per_tensor":
            raise ValueError(
                "weight_sync.delta='delta' sends each bucket as one flat buffer of its changes, but "
                "weight_sync.load_format='per_tensor' asks for one broadcast per tensor; set one of them to 'auto'"
            )
        if self.transfer == "sharded" and self.load_format == "per_tensor":
            raise ValueError(
                "weight_sync.transfer='sharded' sends each engine rank one flattened bucket of its blocks, but "
                "weight_sync.load_format='per_tensor' asks for one broadcast per tensor; set one of them to 'auto'"
            )
        return self

    @property
    def bucket_bytes(self) -> int:
        """bucket_mb in bytes (MiB: 2**20), the one conversion."""
        return int(self.bucket_mb * 2**20)
