"""The node map (launch/nodemap.py) and the srun steps (launch/steps.py): roles on the allocation's nodes in order,
every address wired from it, and a map that cannot work refused with the field and the fix named."""

from __future__ import annotations

import pytest

from megatron_sao.config import ConfigError, load_config
from megatron_sao.config.tree import SAOConfig
from megatron_sao.launch.nodemap import Node, NodeMapError, placeholder_nodes, plan
from megatron_sao.launch.steps import build_steps

SLURM = ["--launch.mode", "slurm", "--launch.gpus_per_node", "0", "--model.hf_path", "/m"]


def _cfg(*overrides: str) -> SAOConfig:
    return load_config("examples/tiny_cpu/config.yaml", [*SLURM, *overrides])


def _nodes(n: int) -> list[Node]:
    return [Node(f"n{i}", "127.0.0.1") for i in range(1, n + 1)]


def test_roles_take_the_nodes_in_order_and_every_address_follows() -> None:
    cfg = _cfg("--launch.nproc_per_node", "2", "--launch.rollout_nodes", "1", "--launch.worker_nodes", "1",
               "--rollout.num_engines", "2", "--launch.workers_per_node", "2", "--parallel.expert", "2")  # fmt: skip
    nodes = [Node("a", "10.0.0.1"), Node("b", "10.0.0.2"), Node("c", "10.0.0.3"), Node("d", "10.0.0.4")]
    m = plan(cfg, nodes)
    assert [n.name for n in m.learner] == ["a"] and [n.name for n in m.unused] == ["d"]
    assert m.engine_urls == ["http://10.0.0.2:30000", "http://10.0.0.2:30001"]
    assert [(w.worker_id, w.node.name, w.shard) for w in m.workers] == [("rollout-0", "c", (0, 2)),
                                                                       ("rollout-1", "c", (1, 2))]  # fmt: skip
    assert m.bus_bind == "tcp://10.0.0.1:5555" and m.bus_connect == "tcp://10.0.0.1:5555"
    assert m.rdzv == "10.0.0.1:29400"
    steps = {s.name: s for s in build_steps(cfg, "c.yaml", ["--learner.max_steps", "3"], m, python="py")}
    assert list(steps) == ["engine-0", "engine-1", "learner", "rollout-0", "rollout-1"]
    engine = steps["engine-1"].command
    assert engine[engine.index("--host") + 1] == "10.0.0.2" and engine[engine.index("--port") + 1] == "30001"
    learner = steps["learner"].command
    assert learner[:2] == ("bash", "-c") and '--node-rank="$SLURM_NODEID"' in learner[2]
    assert "--nproc-per-node=2" in learner and "--master-addr=10.0.0.1" in learner
    assert learner[learner.index("--engines") + 1] == "http://10.0.0.2:30000,http://10.0.0.2:30001"
    assert learner[-2:] == ("--bus.bind", "tcp://10.0.0.1:5555") and "--learner.max_steps" in learner
    worker = steps["rollout-1"].command
    assert worker[worker.index("--shard") + 1] == "1/2" and worker[-2:] == ("--bus.connect", "tcp://10.0.0.1:5555")
    srun = steps["learner"].srun(["--mpi=none"])
    assert srun[:2] == ["srun", "--overlap"] and "--nodelist=a" in srun and "--mpi=none" in srun


def test_without_engine_or_worker_nodes_everything_shares_the_first_learner_node() -> None:
    m = plan(_cfg(), _nodes(1))
    assert m.engine_urls == ["http://127.0.0.1:30000"] and m.workers[0].node.name == "n1"


def test_a_wildcard_bus_bind_stays_and_workers_connect_to_the_learner_node() -> None:
    m = plan(_cfg("--bus.bind", "tcp://0.0.0.0:6000"), [Node("a", "10.1.1.1")])
    assert m.bus_bind == "tcp://0.0.0.0:6000" and m.bus_connect == "tcp://10.1.1.1:6000"


@pytest.mark.parametrize(
    ("overrides", "nodes", "message"),
    [
        (["--launch.rollout_nodes", "1", "--launch.worker_nodes", "1"], 2,
         r"allocation has 2 node\(s\) but the roles need 3: launch.nnodes=1 .* launch.rollout_nodes=1 .*--nodes=3"),
        (["--launch.rollout_nodes", "2", "--rollout.num_engines", "3"], 3,
         "rollout.num_engines=3 does not spread evenly over 2 engine node.*multiple of 2"),
        (["--rollout.engine", "sglang", "--rollout.sglang.tp", "16", "--launch.gpus_per_node", "8"], 1,
         r"tp x dp = 16 GPUs per engine over rollout.sglang.nnodes=1 node\(s\) is 16 per node, more than "
         r"launch.gpus_per_node=8: span more nodes \(rollout.sglang.nnodes\)"),
        (["--rollout.engine", "sglang", "--rollout.sglang.tp", "16", "--rollout.sglang.nnodes", "2",
          "--launch.gpus_per_node", "8", "--launch.rollout_nodes", "3", "--rollout.num_engines", "2"], 4,
         r"rollout.num_engines=2 engines spanning rollout.sglang.nnodes=2 nodes each need launch.rollout_nodes=4"),
        (["--rollout.engine", "sglang", "--rollout.sglang.tp", "8", "--rollout.sglang.nnodes", "2",
          "--launch.gpus_per_node", "8", "--launch.rollout_nodes", "2"], 3,
         r"an engine spanning nodes takes them whole, but tp x dp / nnodes = 4 is not launch.gpus_per_node=8"),
        (["--rollout.engine", "sglang", "--rollout.sglang.tp", "4", "--launch.gpus_per_node", "8",
          "--rollout.num_engines", "3"], 1, r"3 SGLang engines per node x 4 GPUs .*raise launch.rollout_nodes to 2"),
        (["--launch.gpus_per_node", "4", "--launch.nproc_per_node", "8", "--parallel.expert", "4"], 1,
         "launch.nproc_per_node=8 learner ranks per node exceed launch.gpus_per_node=4"),
        (["--launch.workers_per_node", "2", "--rollout.cursor_state", "/tmp/c.json"], 1,
         "rollout.cursor_state='/tmp/c.json' names one file, but 2 rollout workers"),
        (["--bus.bind", "ipc:///tmp/bus"], 1, "bus.bind='ipc:///tmp/bus': under launch.mode=slurm .* tcp://0.0.0.0"),
        (["--rollout.engine_urls", '["http://x:1"]'], 1, "rollout.engine_urls names running engines"),
    ],
)  # fmt: skip
def test_a_node_map_that_cannot_work_names_the_field(overrides: list[str], nodes: int, message: str) -> None:
    with pytest.raises(NodeMapError, match=message):
        plan(_cfg(*overrides), _nodes(nodes))


def test_local_mode_refuses_cluster_placement_fields() -> None:
    for field, value in (("rollout_nodes", "1"), ("worker_nodes", "1"), ("nnodes", "2"), ("workers_per_node", "2")):
        with pytest.raises(ConfigError, match=f"launch.{field}={value}.*launch.mode"):
            load_config("examples/tiny_cpu/config.yaml", [f"--launch.{field}", value, "--parallel.expert", "1"])


def test_placeholder_nodes_cover_the_roles() -> None:
    cfg = _cfg("--launch.rollout_nodes", "2", "--rollout.num_engines", "4")
    m = plan(cfg, placeholder_nodes(cfg.launch.total_nodes))
    assert [e.node.name for e in m.engines] == ["node002", "node002", "node003", "node003"]


def test_an_engine_spanning_two_nodes_runs_one_part_per_node_meeting_at_its_first() -> None:
    """SGLang's multi-node serving (TP=16 over two 8-GPU nodes): one step per node with --nnodes, its --node-rank
    and node-rank 0's --dist-init-addr; only node-rank 0 has a URL (it serves HTTP) and the learner pushes to it."""
    cfg = _cfg("--rollout.engine", "sglang", "--rollout.sglang.tp", "16", "--rollout.sglang.ep", "16",
               "--rollout.sglang.nnodes", "2", "--launch.gpus_per_node", "8", "--launch.rollout_nodes", "4",
               "--rollout.num_engines", "2", "--launch.nproc_per_node", "1")  # fmt: skip
    nodes = [Node(f"n{i}", f"10.0.0.{i}") for i in range(1, 6)]
    m = plan(cfg, nodes)
    assert [[n.name for n in e.span] for e in m.engines] == [["n2", "n3"], ["n4", "n5"]]
    assert m.engine_urls == ["http://10.0.0.2:30000", "http://10.0.0.4:30001"]
    steps = {s.name: s for s in build_steps(cfg, "c.yaml", [], m, python="py")}
    assert [n for n in steps if n.startswith("engine")] == ["engine-0", "engine-0-node1", "engine-1", "engine-1-node1"]
    for name, node, rank, meet in (
        ("engine-1", "n4", 0, "10.0.0.4:31001"),
        ("engine-1-node1", "n5", 1, "10.0.0.4:31001"),
    ):
        cmd = steps[name].command
        assert steps[name].nodes == (node,)
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == str(rank)
        assert cmd[cmd.index("--dist-init-addr") + 1] == meet and cmd[cmd.index("--tp-size") + 1] == "16"
        assert cmd[cmd.index("--base-gpu-id") + 1] == "0"
    assert steps["engine-1"].url == "http://10.0.0.4:30001" and steps["engine-1-node1"].url is None
    learner = steps["learner"].command
    assert learner[learner.index("--engines") + 1] == "http://10.0.0.2:30000,http://10.0.0.4:30001"
    with pytest.raises(ConfigError, match="rollout.sglang.nnodes=3 does not divide"):
        _cfg("--rollout.sglang.tp", "16", "--rollout.sglang.nnodes", "3")
