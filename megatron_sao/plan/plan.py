"""`python -m megatron_sao plan`: will this config fit on this cluster? The topology checks (world sizes,
divisibility, EP against the experts, ETP, the PP layer split, engines per node, SGLang's TP/EP rules), per-GPU
memory of every learner stage (policy + critic) and of an engine GPU, and the weight push's bytes and time.
Every misfit names the config field to change; a learner that does not fit also gets the nearest settings that do."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sao.config.model import read_hf_config_json
from megatron_sao.config.tree import SAOConfig
from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.families import detect_family
from megatron_sao.plan.memory import GB, Activations, EngineMemory, Layout, RoleMemory, engine_memory, role_memory
from megatron_sao.plan.tensors import Architecture, Counts, hf_counts, model_tensors

RUNTIME_RESERVE_GB = 3.0
"""Per learner GPU beyond the tensors: CUDA context, NCCL communicators' buffers, cuBLAS/TE workspaces."""
LINK_EFFICIENCY = 0.9
"""Share of a NIC's line rate a large NCCL broadcast reaches."""
BUCKET_OVERHEAD_S = 0.005
"""Per bucket of a push: the HTTP request, SGLang's dispatch, kernel launches (docs/weight_sync.md). Paid bucket after
bucket over the whole push: every stage's buckets go in ONE order (weight_sync/sender.py PushOrder) and an SGLang
engine holds its pause across each update's receive and load, so no two buckets' control overlaps."""
CONTROL_CALL_S = 0.005
"""Per control call of a push (pause, begin, marker, end, verify, continue): each engine answers in parallel, one
call after the other."""
COPY_EFFICIENCY = 0.35
"""A device-to-device copy's rate as a share of HBM bandwidth (it reads and writes every byte, at ~70%): the
embedded engine's commit of a staged push into its live parameters."""
H2D_GB_S = 25.0
"""A host-to-GPU copy from pinned memory per GPU, GB/s (PCIe Gen5 x16 is 64 GB/s a direction; about 25 measured
with several GPUs of a node copying at once): the push agent's handover moves each rank's slice over it."""
HANDOVER_CALLS = 4
"""Per push and engine, the push agent's calls around its handover: pause, begin, end, continue."""
DELTA_DENSITY = {2: 0.0114, 1: 0.0017}
"""Share of engine-dtype units that change per push at the paper's policy lr (1e-6), by unit (bf16: 2 bytes, FP8: 1),
measured by benchmarks/delta_density.py (docs/weight_sync.md, "How much of a push changes"): the default of
--delta-density."""

FIELD = re.compile(r"\b((?:launch|rollout|parallel|learner|model|weight_sync|bus|algo)\.[a-z_]+(?:\.[a-z_]+)*)")


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    engine_gpu_mem_gb: float | None = None
    """Engine nodes' GPUs when they differ from the learner's (e.g. H200 engines beside H100 learners)."""
    ib_gbps: float = 400.0
    """Network bandwidth into one GPU (its NIC), Gb/s."""
    nvlink_gb_s: float = 450.0
    """NVLink bandwidth out of one learner GPU, GB/s per direction (H100/H200: 900 GB/s both ways)."""
    engine_hbm_tb_s: float | None = None
    """Engine GPUs' HBM bandwidth, TB/s (None: an H200's 4.8 when engine GPUs have more than 80 GB, else an
    H100's 3.35)."""
    host_mem_gb: float = 2048.0
    """Host memory of one node (an 8-GPU H100/H200 node: 2 TB): where deltas' bases live."""

    @property
    def engine_hbm_bytes_s(self) -> float:
        return (self.engine_hbm_tb_s or (4.8 if self.engine_mem_gb > 80 else 3.35)) * 1e12

    @property
    def engine_mem_gb(self) -> float:
        return self.engine_gpu_mem_gb or self.gpu_mem_gb


@dataclass(frozen=True)
class Misfit:
    field: str
    message: str


@dataclass
class StagePlan:
    """One pipeline stage's GPU: the learner's (policy, and the critic unless it has its own ranks), or the value
    job's (critic only, no push staging)."""

    stage: int
    layers: int
    policy: RoleMemory | None
    critic: RoleMemory | None
    sync_staging: float
    reserve: float

    @property
    def roles(self) -> list[RoleMemory]:
        return [r for r in (self.policy, self.critic) if r is not None]

    @property
    def activations(self) -> float:
        return max((r.activations.peak for r in self.roles if isinstance(r.activations, Activations)), default=0.0)

    @property
    def total(self) -> float:
        return sum(r.static for r in self.roles) + max(self.activations, self.sync_staging) + self.reserve


CONTROL_CALLS_PER_ENGINE = 6
"""Per push and engine, beside one update request per bucket: pause, begin, the end-of-push marker, end, verify,
continue (weight_sync/engines.py)."""


@dataclass(frozen=True)
class PushPath:
    """One way a push reaches the engines, per push: what each engine GPU receives, the transfer (the learner's
    sources busy), and how long the engines stop decoding."""

    name: str
    engines: str
    """The engines that take it (docs/weight_sync.md, release table)."""
    bytes_per_engine_rank: float
    transfer_s: float
    stall_s: float
    """Seconds the engines do not decode: the whole push where they pause for it, else the commit."""
    staging_bytes: float = 0.0
    """Extra memory per engine GPU while a push is received (staged beside the live weights)."""
    relays: int = 1
    """Learner GPUs per stage whose NICs the push leaves through (the source, and the sharded path's relays)."""
    waits_for_stall: bool = False
    """The learner waits for the stall after the transfer (the agent's handover; the sharded path's commit is
    counted the same way when it is shorter than the transfer)."""
    host_bytes: float = 0.0
    """Deltas: host memory per node for the bases (a learner node's stage source, an engine node's agents)."""

    @property
    def push_s(self) -> float:
        """The learner's seconds per push: the transfer, then the engines' commit or handover, which it waits for."""
        waits = self.waits_for_stall or self.stall_s < self.transfer_s
        return self.transfer_s + (self.stall_s if waits else 0.0)


@dataclass
class SyncPlan:
    bytes_per_engine_rank: float
    buckets: int
    sources: int
    seconds: float
    floor_seconds: float
    engines: int = 1
    paths: dict[str, PushPath] = field(default_factory=dict)
    taken: str = "full"
    """The path the config's engines take: SGLang's ranks take full tensors, or their slices from push agents
    (weight_sync.agent), as deltas with weight_sync.delta; the embedded engine, which takes the sharded path, runs on
    CPU and is not planned."""
    delta_density: float = 0.0
    """Engine-dtype units changed per push, the deltas' paths are planned at (given, or measured at the paper's lr)."""
    delta_fraction: float = 1.0
    """A delta's bytes over the full push's at that density (the smallest encoding: distributed/delta.py)."""

    @property
    def path(self) -> PushPath:
        return self.paths[self.taken]

    @property
    def update_requests(self) -> int:
        """/update_weights_from_distributed calls per push: one per bucket to every engine."""
        return self.buckets * self.engines

    @property
    def control_round_trips(self) -> int:
        """Every HTTP call a push makes: the update requests and each engine's control calls."""
        return self.update_requests + CONTROL_CALLS_PER_ENGINE * self.engines


@dataclass
class Plan:
    counts: Counts
    layout: Layout | None
    world: int
    stages: list[StagePlan] = field(default_factory=list)
    engine: EngineMemory | None = None
    engine_concurrency: int = 0
    sync: SyncPlan | None = None
    misfits: list[Misfit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    value_layout: Layout | None = None
    """The value job's layout (config.roles.Jobs.value), else None: the critic shares the learner's ranks."""
    value_world: int = 0
    value_stages: list[StagePlan] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.misfits

    @property
    def worst_stage(self) -> StagePlan | None:
        return max(self.stages, key=lambda s: s.total, default=None)


def read_hf_config(cfg: SAOConfig, config_path: str | Path | None, hf_config: str | Path | None) -> dict[str, Any]:
    """config.json from --hf-config (a file or an HF directory), else model.hf_path, else hf_config.json beside
    the run's config file (the examples ship their models' architecture so they plan without the weights)."""
    candidates = []
    if hf_config is not None:
        p = Path(hf_config)
        candidates.append(p / "config.json" if p.is_dir() else p)
    else:
        if cfg.model.hf_path:
            candidates.append(Path(cfg.model.hf_path) / "config.json")
        if config_path is not None:
            candidates.append(Path(config_path).parent / "hf_config.json")
    for c in candidates:
        if c.is_file():
            hf = read_hf_config_json(c)
            hf.update(cfg.model.hf_overrides)
            return hf
    tried = ", ".join(str(c) for c in candidates) or "nothing"
    raise FileNotFoundError(f"no HF config.json to plan from (tried {tried}): set model.hf_path to the model directory "
                            "or pass --hf-config PATH (a config.json or an HF directory)")  # fmt: skip


def _field(message: str, default: str) -> str:
    m = FIELD.search(message)
    return m.group(1) if m else default


def make_plan(cfg: SAOConfig, hf: dict[str, Any], hw: Hardware, delta_density: float | None = None) -> Plan:
    """`delta_density`: engine-dtype units changed per push for the deltas' paths (default: DELTA_DENSITY)."""
    spec = ModelSpec(family=detect_family(hf, cfg.model.family), hf=hf, dtype=cfg.model.dtype,
                     max_seq_len=cfg.model.max_seq_len)  # fmt: skip
    arch = Architecture.from_spec(spec)
    cfg = cfg.model_copy(deep=True)
    cfg.launch.gpus_per_node = hw.gpus_per_node
    world = cfg.launch.learner_world_size
    plan = Plan(counts=hf_counts(arch), layout=None, world=world)
    _check_topology(cfg, arch, hw, plan)
    if plan.layout is not None:
        _plan_learner(cfg, arch, hw, plan)
    if plan.value_layout is not None:
        _plan_value_job(cfg, arch, hw, plan)
    if cfg.rollout.engine == "sglang":
        _plan_engines(cfg, arch, hw, plan)
        _plan_sync(cfg, hw, plan, delta_density)
    else:
        plan.notes.append("rollout.engine=embedded: CPU engines, no engine GPU memory to plan")
    return plan


def _check_topology(cfg: SAOConfig, arch: Architecture, hw: Hardware, plan: Plan) -> None:
    from megatron_sao.launch.nodemap import NodeMapError, placeholder_nodes
    from megatron_sao.launch.nodemap import plan as node_map
    from megatron_sao.learner.learner import check_learner_parallelism

    p, r = cfg.parallel, cfg.rollout
    checks = [
        ("parallel.context", lambda: check_learner_parallelism(p)),
        ("parallel.expert", lambda: p.check_num_experts(arch.experts or 0)),
        ("parallel.tensor", lambda: p.check_attention_heads(arch.heads, arch.kv_heads if arch.mla is None else None)),
    ]
    for name, check in checks:
        try:
            check()
        except ValueError as e:
            plan.misfits.append(Misfit(_field(str(e), name), str(e)))
    etp = p.resolved_expert_tensor
    if arch.experts and arch.moe_ffn % etp:
        plan.misfits.append(Misfit("parallel.expert_tensor", f"parallel.expert_tensor={etp} does not divide the "
                                   f"experts' {arch.moe_ffn} hidden units (moe_intermediate_size)"))  # fmt: skip
    try:
        plan.layout = Layout.of(p, plan.world, arch.num_layers)
    except ValueError as e:
        plan.misfits.append(Misfit(_field(str(e), "parallel.pipeline"), str(e)))
    value_job = cfg.jobs.value
    if value_job is not None:
        vp = value_job.parallel
        plan.value_world = value_job.world_size
        try:
            if arch.experts:
                vp.check_num_experts(arch.experts)
            vp.check_attention_heads(arch.heads, arch.kv_heads if arch.mla is None else None)
            plan.value_layout = Layout.of(vp, plan.value_world, arch.num_layers)
        except ValueError as e:
            plan.misfits.append(Misfit("learner.value_parallel", f"the value job ({plan.value_world} ranks): {e}"))
    if cfg.launch.mode == "slurm":
        try:
            node_map(cfg, placeholder_nodes(hw.nodes))
        except NodeMapError as e:
            plan.misfits.append(Misfit(_field(str(e), "launch.nnodes"), str(e)))
    elif cfg.launch.nproc_per_node > hw.gpus_per_node:
        plan.misfits.append(Misfit("launch.nproc_per_node", f"launch.nproc_per_node={cfg.launch.nproc_per_node} "
                                   f"exceeds --gpus-per-node={hw.gpus_per_node}"))  # fmt: skip
    if r.engine == "sglang":
        s = r.sglang
        if s.tp % s.ep:
            plan.misfits.append(Misfit("rollout.sglang.ep", f"rollout.sglang.ep={s.ep} must divide rollout.sglang.tp="
                                       f"{s.tp}: SGLang's expert parallelism runs inside the TP group"))  # fmt: skip
        if arch.experts and arch.experts % s.ep:
            plan.misfits.append(Misfit("rollout.sglang.ep", f"rollout.sglang.ep={s.ep} does not divide the model's "
                                       f"{arch.experts} routed experts"))  # fmt: skip
        if arch.heads % s.tp:
            plan.misfits.append(Misfit("rollout.sglang.tp", f"rollout.sglang.tp={s.tp} does not divide the model's "
                                       f"{arch.heads} attention heads"))  # fmt: skip
        if arch.mla is None and s.tp % arch.kv_heads and arch.kv_heads % s.tp:
            msg = f"rollout.sglang.tp={s.tp} and the model's {arch.kv_heads} KV heads: one must divide the other"
            plan.misfits.append(Misfit("rollout.sglang.tp", msg + " (SGLang splits or replicates them)"))


def _learner_stages(cfg: SAOConfig, arch: Architecture, layout: Layout, hw: Hardware, *, tokens: int,
                    recompute: str, roles: tuple[str, ...] | None = None) -> list[StagePlan]:  # fmt: skip
    """Every stage of `layout` holding `roles` (default: what the learner's ranks hold: the policy, and the critic
    for sao unless it has ranks of its own); the push's staging on stages that hold the policy."""
    learner = cfg.learner
    if roles is None:
        roles = tuple(sorted(cfg.jobs.learner.roles))
    use_te = cfg.model.dtype == "bf16"  # GPU bf16: Transformer Engine layers, fused attention
    common = dict(dtype=cfg.model.dtype, distributed_optimizer=learner.use_distributed_optimizer,
                  tokens=largest_microbatch(cfg, tokens), recompute=recompute, flash_attention=use_te,
                  te_layout=use_te, microbatches=-(-learner.trajectories_per_step // layout.dp))  # fmt: skip
    tensors = model_tensors(arch, "policy", tensor_parallel=layout.tp, te_layout=use_te)
    critic_tensors = model_tensors(arch, "value", tensor_parallel=layout.tp, te_layout=use_te)
    bucket = cfg.weight_sync.bucket_bytes
    stages = []
    for stage in range(layout.pp):
        policy = critic = None
        if "policy" in roles:
            policy = role_memory(arch, "policy", layout, stage, tensors=tensors, **common)
        if "value" in roles:
            critic = role_memory(arch, "value", layout, stage, tensors=critic_tensors, **common)
        held = [t for t in tensors if t.layer is None or t.layer in layout.stage_range(stage)]
        largest = max((t.numel * 2 for t in held if t.split != "replicated"), default=0)
        # the source's send buffer, the gather's receive area, one assembled tensor; the value job pushes nothing
        staging = 2 * bucket + largest if policy is not None else 0.0
        stages.append(StagePlan(stage, len(layout.stage_range(stage)), policy, critic, staging,
                                RUNTIME_RESERVE_GB * GB))  # fmt: skip
    return stages


def largest_microbatch(cfg: SAOConfig, tokens: int) -> int:
    """The longest packed micro-batch: the budget, or one episode longer than it (learner/packing.py gives such an
    episode a micro-batch of its own)."""
    return max(tokens, min(cfg.rollout.max_total_tokens, cfg.model.max_seq_len))


def _plan_learner(cfg: SAOConfig, arch: Architecture, hw: Hardware, plan: Plan) -> None:
    assert plan.layout is not None
    learner = cfg.learner
    plan.stages = _learner_stages(cfg, arch, plan.layout, hw, tokens=learner.max_tokens_per_microbatch,
                                  recompute=learner.recompute)  # fmt: skip
    worst = plan.worst_stage
    limit = hw.gpu_mem_gb * GB
    if worst is None or worst.total <= limit:
        return
    need = f"learner stage {worst.stage} needs {worst.total / GB:.1f} GB per GPU, more than --gpu-mem-gb="
    need += f"{hw.gpu_mem_gb:g}"
    for change in _learner_changes(cfg, arch, hw):
        trial = cfg.model_copy(deep=True)
        for key, value in change.items():
            section, name = key.split(".")
            setattr(getattr(trial, section), name, value)
        try:
            layout = Layout.of(trial.parallel, trial.launch.learner_world_size, arch.num_layers)
        except ValueError:
            continue
        stages = _learner_stages(trial, arch, layout, hw, tokens=trial.learner.max_tokens_per_microbatch,
                                 recompute=trial.learner.recompute)  # fmt: skip
        peak = max(s.total for s in stages)
        if peak <= limit:
            fix = " and ".join(f"{k}={v}" for k, v in change.items())
            plan.misfits.append(Misfit(next(iter(change)), f"{need}; {fix} fits ({peak / GB:.1f} GB)"))
            return
    static = sum(r.static for r in worst.roles) + worst.reserve
    if static > limit:
        plan.misfits.append(Misfit("launch.nnodes", f"{need}: parameters, gradients and optimizer state alone take "
                                   f"{static / GB:.1f} GB; raise launch.nnodes (more data-parallel ranks shard the "
                                   "optimizer state) or parallel.expert / parallel.pipeline"))  # fmt: skip
    else:
        plan.misfits.append(Misfit("rollout.max_total_tokens", f"{need}: episodes reach {largest_microbatch(cfg, 0)} "
                                   "tokens (rollout.max_total_tokens), a micro-batch of their own; lower it, or raise "
                                   "parallel.tensor (sequence parallelism splits them)"))  # fmt: skip


def _plan_value_job(cfg: SAOConfig, arch: Architecture, hw: Hardware, plan: Plan) -> None:
    """The value job's stages (critic only) at its own layout; a stage over the GPU is a misfit naming its fields."""
    assert plan.value_layout is not None
    plan.value_stages = _learner_stages(cfg, arch, plan.value_layout, hw, tokens=cfg.learner.max_tokens_per_microbatch,
                                        recompute=cfg.learner.recompute, roles=("value",))  # fmt: skip
    worst = max(plan.value_stages, key=lambda s: s.total)
    if worst.total > hw.gpu_mem_gb * GB:
        plan.misfits.append(Misfit("learner.value_parallel", f"value job stage {worst.stage} needs "
                                   f"{worst.total / GB:.1f} GB per GPU, more than --gpu-mem-gb={hw.gpu_mem_gb:g}: "
                                   "raise learner.value_parallel.pipeline / .expert or its ranks "
                                   "(launch.value_nnodes, launch.value_nproc_per_node)"))  # fmt: skip


def _learner_changes(cfg: SAOConfig, arch: Architecture, hw: Hardware) -> list[dict[str, Any]]:
    """Settings to try, least disruptive first: full recompute, smaller micro-batch budgets (with it), a doubled
    tensor-parallel size within a node, then twice the learner nodes when the cluster has them."""
    tokens, recompute = cfg.learner.max_tokens_per_microbatch, cfg.learner.recompute
    out: list[dict[str, Any]] = []
    if recompute != "full":
        out.append({"learner.recompute": "full"})
    for t in _halvings(tokens):
        out.append({"learner.max_tokens_per_microbatch": t})
        if recompute != "full":
            out.append({"learner.recompute": "full", "learner.max_tokens_per_microbatch": t})
    tp = cfg.parallel.tensor * 2
    if tp <= hw.gpus_per_node and arch.heads % tp == 0 and (arch.mla or arch.kv_heads % tp == 0):
        out.append({"parallel.tensor": tp, **({"learner.recompute": "full"} if recompute != "full" else {})})
    la = cfg.launch
    if la.total_nodes + la.nnodes <= hw.nodes:
        out.append({"launch.nnodes": 2 * la.nnodes})
    return out


def _halvings(tokens: int) -> list[int]:
    out, t = [], tokens // 2
    while t >= 1024:
        out.append(t)
        t //= 2
    return out


def _engine_dtype_bytes(extra_args: list[str]) -> tuple[int, int, list[str]]:
    """(weight bytes, KV bytes, notes) from SGLang's --quantization / --kv-cache-dtype in rollout.sglang.extra_args."""
    args = " ".join(extra_args)
    notes = []
    weight = 2
    m = re.search(r"--quantization[= ](\S+)", args)
    if m and "fp8" in m.group(1):
        weight = 1
        notes.append(f"engines serve {m.group(1)} weights (--quantization): 1 byte per parameter")
    kv = 1 if re.search(r"--kv-cache-dtype[= ]fp8", args) else 2
    return weight, kv, notes


def _plan_engines(cfg: SAOConfig, arch: Architecture, hw: Hardware, plan: Plan) -> None:
    r, la = cfg.rollout, cfg.launch
    workers = max(la.worker_nodes, la.rollout_nodes, 1) * la.workers_per_node if la.mode == "slurm" else 1
    per_engine = math.ceil(workers * r.concurrency / r.num_engines)
    plan.engine_concurrency = per_engine
    weight_bytes, kv_bytes, notes = _engine_dtype_bytes(r.sglang.extra_args)
    plan.notes += notes
    mem = engine_memory(arch, tp=r.sglang.tp, gpu_mem=hw.engine_mem_gb * GB, mem_fraction=r.sglang.mem_fraction_static,
                        concurrency=per_engine, max_total_tokens=r.max_total_tokens, weight_bytes=weight_bytes,
                        kv_bytes=kv_bytes)  # fmt: skip
    plan.engine = mem
    budget = r.sglang.mem_fraction_static * hw.engine_mem_gb
    if mem.pool <= 0:
        plan.misfits.append(Misfit("rollout.sglang.tp", f"an engine GPU holds {mem.weights / GB:.1f} GB of weights "
                                   f"(TP={r.sglang.tp}), more than rollout.sglang.mem_fraction_static x "
                                   f"{hw.engine_mem_gb:g} GB = {budget:.1f} GB: raise rollout.sglang.tp (beyond a "
                                   "node's GPUs with rollout.sglang.nnodes), serve a block-FP8 checkpoint "
                                   "(rollout.model_path, --quantization fp8) or use larger GPUs "
                                   "(--engine-gpu-mem-gb)"))  # fmt: skip
        return
    if r.sglang.gpus_per_node > hw.gpus_per_node:
        plan.misfits.append(Misfit("rollout.sglang.nnodes", f"an engine takes rollout.sglang.tp x dp = {r.sglang.gpus} "
                                   f"GPUs, {r.sglang.gpus_per_node} per node over rollout.sglang.nnodes="
                                   f"{r.sglang.nnodes}, more than a node's {hw.gpus_per_node}: span "
                                   f"{-(-r.sglang.gpus // hw.gpus_per_node)} nodes"))  # fmt: skip
    if mem.capacity_tokens < r.max_total_tokens:
        msg = f"an engine's KV cache holds {mem.capacity_tokens:,.0f} tokens, fewer than one episode of "
        plan.misfits.append(Misfit("rollout.max_total_tokens", msg + f"rollout.max_total_tokens={r.max_total_tokens}"))
    elif mem.capacity_tokens < mem.demand_tokens:
        full = int(mem.capacity_tokens // r.max_total_tokens)
        mean = mem.capacity_tokens / per_engine
        plan.notes.append(
            f"an engine's KV cache holds {mem.capacity_tokens:,.0f} tokens: {full} of its {per_engine} concurrent "
            f"episodes at full length ({r.max_total_tokens} tokens); SGLang queues or retracts the rest when long "
            f"episodes pile up (episodes of {mean:,.0f} tokens on average all fit)"
        )


def delta_fraction(density: float, unit: int) -> float:
    """A delta's bytes over the full bytes at `density` (changed units per unit), the smallest encoding."""
    from megatron_sao.distributed.delta import sizes

    units = 1 << 20
    return min(sizes(units, round(density * units), unit).values()) / (units * unit)


def _plan_sync(cfg: SAOConfig, hw: Hardware, plan: Plan, delta_density: float | None = None) -> None:
    """SGLang's update_weights_from_distributed hands every engine rank full tensors: each receives the whole
    model, from one source per pipeline stage, in one order; docs/weight_sync.md. Engines serving a block-FP8
    checkpoint receive its format: one byte per quantized parameter (embeddings, norms and routers stay bf16; the
    scales add 4 bytes per 128x128 block)."""
    fp8_engines = _engine_dtype_bytes(cfg.rollout.sglang.extra_args)[0] == 1
    c = plan.counts
    total = c.total + c.embeddings + c.total * 4 // (128 * 128) if fp8_engines else c.total * 2
    bucket = cfg.weight_sync.bucket_bytes
    pp = plan.layout.pp if plan.layout else 1
    bandwidth = hw.ib_gbps / 8 * 1e9 * LINK_EFFICIENCY
    receiver = total / bandwidth
    source = total / pp / bandwidth
    # buckets fill to bucket_bytes within each stage's dense tensors and within its experts (weight_sync/plan.py)
    experts = c.routed + c.routed * 4 // (128 * 128) if fp8_engines else c.routed * 2
    buckets = pp * (math.ceil((total - experts) / pp / bucket) + math.ceil(experts / pp / bucket))
    floor = max(receiver, source)
    control = buckets * BUCKET_OVERHEAD_S + CONTROL_CALLS_PER_ENGINE * CONTROL_CALL_S
    seconds = floor + control
    plan.sync = SyncPlan(bytes_per_engine_rank=total, buckets=buckets, sources=pp, seconds=seconds, floor_seconds=floor,
                         engines=cfg.rollout.num_engines)  # fmt: skip
    # the full-tensor broadcast SGLang's ranks take: paused for the whole push (pause_mode none is refused there)
    plan.sync.paths["full"] = PushPath("full", "SGLang (all releases)", total, seconds, seconds)
    # shard-aware (the embedded engine's sharded_bucket): each rank receives its 1/TP share (replicated norms and
    # routers, < 0.1%, not counted). The buckets go one at a time in the push order; each is cut into one buffer
    # per block group (engine TP rank), broadcast by the stage's relays (weight_sync/relay.py: its ranks on the
    # source's node, one group each, up to TP of them), which the source hands them over NVLink. So a bucket leaves
    # the node through `relays` NICs: the transfer is the largest of what one engine rank receives, what one relay
    # sends, and what the source hands its relays over NVLink (pipelined bucket by bucket). The engines decode
    # throughout and stop only for the commit, a device copy of what they staged.
    tp = cfg.rollout.sglang.tp
    rank = total / tp
    relays = max(1, min(tp, hw.gpus_per_node, plan.world // pp))
    handed = total * (relays - 1) / relays / (hw.nvlink_gb_s * 1e9 * LINK_EFFICIENCY)
    transfer = max(rank / bandwidth, total / relays / bandwidth, handed) + control
    commit = rank / (COPY_EFFICIENCY * hw.engine_hbm_bytes_s)
    plan.sync.paths["sharded"] = PushPath("sharded", "embedded engine", rank, transfer, commit, staging_bytes=rank,
                                          relays=relays)  # fmt: skip
    # the push agent beside SGLang (engines/agent/, "hf" handover): each rank takes the dense tensors whole and only the
    # experts its expert-parallel rank stores. A dense bucket (every rank takes it whole) leaves the source once, over
    # the stage's whole group; an expert bucket as one buffer per expert-parallel rank, through the relays
    # (weight_sync/sender.py). The agent receives beside the engine, which decodes meanwhile; it stops for the
    # handover: its slice copied to the GPU (H2D_GB_S) and loaded into the parameters (a device copy), one call per
    # part of weight_sync.agent_part_mb, and the calls around it.
    ep = max(1, cfg.rollout.sglang.ep)
    dense = total - experts
    agent_rank = dense + experts / ep
    # the buckets go in one order: the dense ones from the source's NIC, the expert ones through as many relays as
    # there are distinct expert sets (one per expert-parallel rank; with ep 1 every bucket is whole, from the source)
    used = min(relays, ep)
    wire = dense / bandwidth + experts / used / bandwidth
    transfer = max(agent_rank / bandwidth, wire,
                   experts * (used - 1) / used / (hw.nvlink_gb_s * 1e9 * LINK_EFFICIENCY)) + control  # fmt: skip
    part = cfg.weight_sync.agent_part_mb * 2**20
    handover = (agent_rank / (H2D_GB_S * 1e9) + agent_rank / (COPY_EFFICIENCY * hw.engine_hbm_bytes_s)
                + math.ceil(agent_rank / part) * BUCKET_OVERHEAD_S + HANDOVER_CALLS * CONTROL_CALL_S)  # fmt: skip
    plan.sync.paths["agent"] = PushPath("agent", "SGLang >= 0.5.21 + push agent", agent_rank, transfer, handover,
                                        staging_bytes=min(part, agent_rank) + bucket, relays=relays,
                                        waits_for_stall=True)  # fmt: skip
    # deltas (weight_sync.delta) on the paths whose receivers keep a base: the embedded engine, and the agent beside
    # SGLang (which hands the engine its full slice: the stall is the same). The source compares each bucket with its
    # base, which lives in host memory and is copied to the GPU bucket by bucket (H2D_GB_S: the stage's bytes per
    # push); the wire carries the delta's share, which a receiver writes into its base in place (no copy)
    unit = 1 if fp8_engines else 2
    density = DELTA_DENSITY[unit] if delta_density is None else delta_density
    frac = delta_fraction(density, unit)
    plan.sync.delta_density, plan.sync.delta_fraction = density, frac
    nvlink = hw.nvlink_gb_s * 1e9 * LINK_EFFICIENCY
    stage = total / pp
    encode = stage / (H2D_GB_S * 1e9)
    sharded = plan.sync.paths["sharded"]
    transfer = max(rank * frac / bandwidth, total * frac / relays / bandwidth, total * frac * (relays - 1) / relays /
                   nvlink, encode) + control  # fmt: skip
    plan.sync.paths["sharded+delta"] = PushPath("sharded+delta", "embedded engine", rank * frac, transfer,
                                                sharded.stall_s, staging_bytes=rank, relays=relays,
                                                host_bytes=stage)  # fmt: skip
    engine_node = agent_rank * hw.gpus_per_node
    transfer = max(agent_rank * frac / bandwidth, wire * frac, experts * frac * (used - 1) / used / nvlink,
                   total / pp / (H2D_GB_S * 1e9)) + control  # fmt: skip
    plan.sync.paths["agent+delta"] = PushPath("agent+delta", "SGLang >= 0.5.21 + push agent", agent_rank * frac,
                                              transfer, handover, staging_bytes=min(part, agent_rank) + bucket,
                                              relays=relays, waits_for_stall=True,
                                              host_bytes=max(total / pp, engine_node))  # fmt: skip
    if cfg.weight_sync.agent:
        plan.sync.taken = "agent+delta" if cfg.weight_sync.delta != "full" else "agent"
    elif cfg.weight_sync.delta == "delta":
        plan.misfits.append(Misfit("weight_sync.delta", "weight_sync.delta='delta': SGLang engines take deltas only "
                                   "through a push agent; set weight_sync.agent true, or weight_sync.delta to auto or "
                                   "full"))  # fmt: skip
    if cfg.weight_sync.delta != "full" and plan.sync.path.host_bytes > hw.host_mem_gb * GB * 0.5:
        plan.misfits.append(Misfit("weight_sync.delta", f"deltas keep {plan.sync.path.host_bytes / GB:.0f} GB of "
                                   f"bases per node, over half of the {hw.host_mem_gb:g} GB host memory; set "
                                   "weight_sync.delta to full, or spread the stages over more nodes"))  # fmt: skip
    # the planned engines are SGLang's, whose ranks take full tensors only (weight_sync/engines.py refuses otherwise)
    if cfg.weight_sync.transfer == "sharded" and not cfg.weight_sync.agent:
        plan.misfits.append(Misfit("weight_sync.transfer", "weight_sync.transfer='sharded': SGLang engines take only "
                                   "full tensors (docs/weight_sync.md, release table): use auto or full"))  # fmt: skip
    if plan.engine is not None and plan.engine.pool - rank < 0:
        plan.notes.append(
            f"a shard-aware push stages {rank / GB:.1f} GB per engine GPU beside its {plan.engine.weights / GB:.1f} "
            f"GB of weights: more than the {max(plan.engine.pool, 0) / GB:.1f} GB KV pool; it needs a larger "
            "rollout.sglang.tp (or larger engine GPUs) to run"
        )


def render(plan: Plan, cfg: SAOConfig, hw: Hardware, title: str) -> str:
    """The plan as rich tables (plain text when not a terminal)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    out = StringIO()
    console = Console(file=out, width=120, force_terminal=False, color_system=None)
    c = plan.counts
    console.print(f"[b]{title}[/b]: {c.total / 1e9:.1f}B parameters, {c.active / 1e9:.1f}B active per token "
                  f"({c.active_without_embeddings / 1e9:.1f}B without embeddings); {hw.nodes} nodes x "
                  f"{hw.gpus_per_node} GPUs, {hw.gpu_mem_gb:g} GB learner GPUs, {hw.engine_mem_gb:g} GB engine GPUs, "
                  f"{hw.ib_gbps:g} Gb/s per GPU")  # fmt: skip
    if plan.layout:
        lay, mb = plan.layout, largest_microbatch(cfg, cfg.learner.max_tokens_per_microbatch)
        console.print(f"learner: {plan.world} ranks, TP={lay.tp} PP={lay.pp} CP={lay.cp} EP={lay.ep} ETP={lay.etp} "
                      f"DP={lay.dp} expert-DP={lay.edp}, layers per stage {list(lay.stage_layers)}, "
                      f"micro-batches of up to {mb} tokens, recompute {cfg.learner.recompute}")  # fmt: skip
    if plan.value_layout:
        lay = plan.value_layout
        console.print(f"value job (learner.value_on_separate_ranks): {plan.value_world} ranks, TP={lay.tp} "
                      f"PP={lay.pp} EP={lay.ep} DP={lay.dp}, layers per stage {list(lay.stage_layers)}")  # fmt: skip
    for title, stages in (("learner", plan.stages), ("value job", plan.value_stages)):
        if not stages:
            continue
        table = Table(title=f"{title} memory per GPU (GB): weights / grads / optimizer, activations at peak")
        for col in ("stage", "layers", "policy w/g/o", "critic w/g/o", "activations", "sync staging", "reserve",
                    "total", f"of {hw.gpu_mem_gb:g}"):  # fmt: skip
            table.add_column(col, justify="right")
        for s in stages:
            table.add_row(str(s.stage), str(s.layers), _wgo(s.policy) if s.policy else "-",
                          _wgo(s.critic) if s.critic else "-", f"{s.activations / GB:.1f}",
                          f"{s.sync_staging / GB:.1f}", f"{s.reserve / GB:.1f}", f"{s.total / GB:.1f}",
                          "fits" if s.total <= hw.gpu_mem_gb * GB else "NO")  # fmt: skip
        console.print(table)
    if plan.engine:
        e, r = plan.engine, cfg.rollout
        table = Table(title=f"engine GPU ({r.num_engines} SGLang servers x TP={r.sglang.tp}, EP={r.sglang.ep})")
        for col in ("weights GB", "KV pool GB", "KV bytes/token", "KV tokens", "episodes/engine", "full-length fit"):
            table.add_column(col, justify="right")
        table.add_row(f"{e.weights / GB:.1f}", f"{max(e.pool, 0) / GB:.1f}", f"{e.kv_bytes_per_token:,.0f}",
                      f"{e.capacity_tokens:,.0f}", str(plan.engine_concurrency),
                      str(int(e.capacity_tokens // r.max_total_tokens)))  # fmt: skip
        console.print(table)
    if plan.sync:
        s = plan.sync
        console.print(
            f"weight push: {s.bytes_per_engine_rank / GB:.1f} GB to every engine rank (full tensors), "
            f"{s.sources} source(s), {s.buckets} buckets of {cfg.weight_sync.bucket_mb:g} MB: {s.seconds:.1f} s "
            f"(floor {s.floor_seconds:.1f} s at {hw.ib_gbps:g} Gb/s x {LINK_EFFICIENCY}); {s.update_requests:,} update "
            f"requests ({s.buckets} buckets x {s.engines} engines), {s.control_round_trips:,} HTTP round trips in all"
        )
        table = Table(title=f"per push, by path (weight_sync.transfer, .agent, .delta; docs/weight_sync.md); deltas at "
                            f"{s.delta_density:.4f} of engine-dtype units changed per push: {s.delta_fraction:.3f} "
                            "of the bytes")  # fmt: skip
        for col in ("path", "engines", "GB per engine rank", "sending GPUs per stage", "transfer s", "engine stall s",
                    "push s", "staging GB/GPU", "bases GB/node (host)", ""):  # fmt: skip
            table.add_column(col, justify="right")
        for p in s.paths.values():
            table.add_row(p.name, p.engines, f"{p.bytes_per_engine_rank / GB:.2f}", str(p.relays),
                          f"{p.transfer_s:.2f}", f"{p.stall_s:.2f}", f"{p.push_s:.2f}", f"{p.staging_bytes / GB:.1f}",
                          f"{p.host_bytes / GB:.0f}" if p.host_bytes else "-",
                          "this config" if p.name == s.taken else "")  # fmt: skip
        console.print(table)
    for n in plan.notes:
        console.print(f"note: {n}")
    if plan.misfits:
        console.print("[b]does not fit[/b]:")
        for m in plan.misfits:
            console.print(f"  {m.field}: {m.message}")
    else:
        console.print("[b]fits[/b]")
    return out.getvalue()


def _wgo(m: RoleMemory) -> str:
    return f"{m.weights / GB:.1f} / {m.grads / GB:.1f} / {m.optimizer / GB:.1f}"
