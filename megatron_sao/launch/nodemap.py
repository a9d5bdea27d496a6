"""Which node runs which role (launch.mode=slurm): the allocation's nodes in order go to the learner (launch.nnodes),
the value job of a critic on its own ranks (launch.value_nnodes; none: it shares the learner's first node), the
engines (launch.rollout_nodes) and the rollout workers (launch.worker_nodes), and every address the roles need
follows from it -- torchrun's rendezvous (the value job's too), the bridge between them, the bus, each engine's URL.
Pure: no Slurm needed (the dry run and the golden tests use it as the real launch does). A node map that cannot work
raises NodeMapError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sao.config.tree import SAOConfig
from megatron_sao.engines.sglang_launcher import engines_per_node

WILDCARD_HOSTS = ("*", "0.0.0.0")


class NodeMapError(ValueError):
    """The allocation and the config do not fit together; the message names the field and the fix."""


@dataclass(frozen=True)
class Node:
    name: str  # Slurm's node name (srun --nodelist)
    addr: str  # where the others reach it (its NodeAddr, resolved)


@dataclass(frozen=True)
class EnginePlace:
    index: int  # port base_port + index
    node: Node  # node-rank 0: it serves HTTP
    slot: int  # its place among its node's engines (which GPUs)
    url: str
    nodes: tuple[Node, ...] = ()  # every node it spans, node-rank order (rollout.sglang.nnodes); () means (node,)

    @property
    def span(self) -> tuple[Node, ...]:
        return self.nodes or (self.node,)


@dataclass(frozen=True)
class WorkerPlace:
    worker_id: str
    node: Node
    shard: tuple[int, int]  # (i, n): every n-th prompt from the i-th


@dataclass(frozen=True)
class NodeMap:
    learner: tuple[Node, ...]
    engines: tuple[EnginePlace, ...]
    workers: tuple[WorkerPlace, ...]
    unused: tuple[Node, ...]
    bus_bind: str  # what the learner binds
    bus_connect: str  # what the workers connect to
    rdzv: str  # host:port of torchrun's rendezvous
    value: tuple[Node, ...] = ()  # the value job's nodes (learner.value_on_separate_ranks)
    value_rdzv: str | None = None  # host:port of the value job's torchrun rendezvous
    critic_bridge: str | None = None  # tcp://host:port the learner's rank 0 serves the bridge to the value job on

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def table(self) -> str:
        """The node map as a few aligned lines (printed by the launcher and the dry run)."""
        roles: dict[str, list[str]] = {}
        for n in self.learner:
            roles.setdefault(n.name, []).append("learner")
        for n in self.value:
            roles.setdefault(n.name, []).append("value job")
        for e in self.engines:
            for n in e.span:
                roles.setdefault(n.name, []).append(f"engine-{e.index}")
        for w in self.workers:
            roles.setdefault(w.node.name, []).append(w.worker_id)
        for n in self.unused:
            roles.setdefault(n.name, []).append("(unused)")
        addrs = {n.name: n.addr for n in (*self.learner, *self.value, *self.unused)}
        addrs.update({n.name: n.addr for e in self.engines for n in e.span})
        addrs.update({w.node.name: w.node.addr for w in self.workers})
        width = max(len(name) for name in roles)
        lines = [f"  {name:<{width}}  {addrs[name]:<15}  {', '.join(r)}" for name, r in roles.items()]
        return "\n".join(lines)


def _host_of(address: str, field: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise NodeMapError(f"{field}={address!r}: under launch.mode=slurm the rollout workers reach the learner over "
                           "TCP from other nodes; set it to tcp://0.0.0.0:PORT (or tcp://*:PORT)")  # fmt: skip
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def plan(cfg: SAOConfig, nodes: list[Node]) -> NodeMap:
    """The node map of `cfg` on `nodes` (the allocation's, in order)."""
    la, r = cfg.launch, cfg.rollout
    need = la.total_nodes
    if len(nodes) < need:
        raise NodeMapError(
            f"the allocation has {len(nodes)} node(s) but the roles need {need}: launch.nnodes={la.nnodes} (learner) + "
            f"launch.value_nnodes={la.value_nnodes} (value job) + launch.rollout_nodes={la.rollout_nodes} (engines) + "
            f"launch.worker_nodes={la.worker_nodes} (rollout workers); allocate {need} nodes (sbatch/salloc "
            f"--nodes={need}; ./launch.sh submit asks for them) or lower those fields"
        )  # fmt: skip
    if r.engine_urls:
        raise NodeMapError("rollout.engine_urls names running engines, but under launch.mode=slurm the launcher "
                           "starts the engines on launch.rollout_nodes; leave rollout.engine_urls empty")  # fmt: skip
    learner = tuple(nodes[: la.nnodes])
    first_engine = la.nnodes + la.value_nnodes
    separate = cfg.jobs.value is not None
    value = (tuple(nodes[la.nnodes : first_engine]) or learner[:1]) if separate else ()
    if la.value_nnodes and not separate:
        raise NodeMapError(f"launch.value_nnodes={la.value_nnodes} but learner.value_on_separate_ranks=false: there is "
                           "no value job to place; set launch.value_nnodes=0")  # fmt: skip
    if separate and la.gpus_per_node:
        beside = la.nproc_per_node if not la.value_nnodes else 0  # the value job shares the learner's first node
        if la.value_nproc_per_node + beside > la.gpus_per_node:
            raise NodeMapError(f"the value job's launch.value_nproc_per_node={la.value_nproc_per_node} ranks "
                               + (f"beside the learner's {beside} " if beside else "")
                               + f"exceed launch.gpus_per_node={la.gpus_per_node}: one rank per GPU; give it nodes "
                               "of its own (launch.value_nnodes) or lower launch.value_nproc_per_node")  # fmt: skip
    engine_nodes = list(nodes[first_engine : first_engine + la.rollout_nodes]) or [learner[0]]
    worker_nodes = list(nodes[first_engine + la.rollout_nodes : need]) or engine_nodes
    if la.gpus_per_node and la.nproc_per_node > la.gpus_per_node:
        raise NodeMapError(f"launch.nproc_per_node={la.nproc_per_node} learner ranks per node exceed "
                           f"launch.gpus_per_node={la.gpus_per_node}: one rank per GPU; lower launch.nproc_per_node "
                           "and raise launch.nnodes")  # fmt: skip
    span, span_field = r.engine_nnodes
    if span > 1 and len(engine_nodes) != r.num_engines * span:
        raise NodeMapError(
            f"rollout.num_engines={r.num_engines} engines spanning {span_field}={span} nodes "
            f"each need launch.rollout_nodes={r.num_engines * span}, not {len(engine_nodes)}"
        )
    groups = [tuple(engine_nodes[i : i + span]) for i in range(0, len(engine_nodes), span)]
    if r.num_engines % len(groups):
        raise NodeMapError(f"rollout.num_engines={r.num_engines} does not spread evenly over {len(engine_nodes)} "
                           f"engine node(s) (launch.rollout_nodes={la.rollout_nodes}): make rollout.num_engines a "
                           f"multiple of {len(engine_nodes)}")  # fmt: skip
    per_node = r.num_engines // len(groups)
    try:
        fit = engines_per_node(r, la.gpus_per_node)
    except ValueError as e:
        raise NodeMapError(str(e)) from None
    if fit is not None and per_node > fit:
        raise NodeMapError(f"{per_node} SGLang engines per node x {r.sglang.gpus} GPUs (rollout.sglang.tp x dp) "
                           f"exceed launch.gpus_per_node={la.gpus_per_node}: raise launch.rollout_nodes to "
                           f"{-(-r.num_engines // fit)} or lower rollout.num_engines")  # fmt: skip
    engines = tuple(
        EnginePlace(i, group[0], slot, f"http://{group[0].addr}:{r.base_port + i}", group if span > 1 else ())
        for n, group in enumerate(groups)
        for slot, i in enumerate(range(n * per_node, (n + 1) * per_node))
    )
    count = len(worker_nodes) * la.workers_per_node
    if count > 1 and r.cursor_state:
        raise NodeMapError(f"rollout.cursor_state={r.cursor_state!r} names one file, but {count} rollout workers each "
                           "keep their own cursor: leave rollout.cursor_state unset (each worker then keeps "
                           "<run_dir>/rollout_cursor_<id>.json)")  # fmt: skip
    workers = tuple(
        WorkerPlace(f"rollout-{i}", worker_nodes[i // la.workers_per_node], (i, count)) for i in range(count)
    )
    host, port = _host_of(cfg.bus.bind, "bus.bind")
    if cfg.bus.connect is not None:
        _host_of(cfg.bus.connect, "bus.connect")
    bind = cfg.bus.bind if host in WILDCARD_HOSTS else f"tcp://{learner[0].addr}:{port}"
    return NodeMap(
        learner=learner,
        engines=engines,
        workers=workers,
        unused=tuple(nodes[need:]),
        bus_bind=bind,
        bus_connect=cfg.bus.connect or f"tcp://{learner[0].addr}:{port}",
        rdzv=f"{learner[0].addr}:{la.rdzv_port}",
        value=value,
        value_rdzv=f"{value[0].addr}:{la.rdzv_port + 1}" if value else None,
        critic_bridge=f"tcp://{learner[0].addr}:{la.rdzv_port + 2}" if value else None,
    )


def placeholder_nodes(count: int) -> list[Node]:
    """Node names for a dry run outside an allocation (node001, node002, ...; each its own address)."""
    return [Node(f"node{i:03d}", f"node{i:03d}") for i in range(1, count + 1)]
