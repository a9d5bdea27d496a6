"""The push agent end to end on CPU (engines/agent/): a learner at TP2 x EP2 x PP2 pushes shard-aware into two TP=2
engines through their agents -- each agent rank receives its engine rank's slice while the engine keeps generating,
then hands it over by /update_weights_from_tensor -- and the engines serve what an engine given a full push serves;
an agent killed mid-push leaves its engine's weights and version as they were."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import SGLangClient
from tests.weight_sync.test_weight_sync import GREEDY, PROMPT, _expected_rank_bytes, _learner, _sync

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]


class AgentProc:
    """`python -m megatron_sao agent` beside one engine."""

    def __init__(self, engine_url: str, log_path: Path, *extra: str) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "megatron_sao", "agent", "--engine", engine_url, "--port", str(self.port), *extra]
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline, client = time.monotonic() + timeout_s, SGLangClient(self.url)
        while True:
            try:
                if client.server_info().get("engine") == P.PUSH_AGENT:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its other ranks too
        self.proc.wait(timeout=30)


@pytest.fixture
def start_agent(tmp_path: Path):
    procs: list[AgentProc] = []

    def start(engine_url: str, *extra: str) -> AgentProc:
        procs.append(AgentProc(engine_url, tmp_path / f"agent{len(procs)}.log", *extra))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()


def _logs(agents: list[AgentProc]) -> str:
    return "\n".join(f"--- {a.log_path.name}\n{a.log_path.read_text()[-4000:]}" for a in agents)


def _push(hf_dir: str, layout: dict[str, int], full_url: str, agent_urls: list[str], port: int) -> dict[str, Any]:
    """The learner's weights scaled, then pushed whole to one engine and shard-aware through the agents."""
    import torch.distributed as dist

    cfg, learner = _learner(hf_dir, layout, port, bucket_mb=0.05)
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.mul_(1.25)
    out: dict[str, Any] = {}
    for key, urls, transfer, offset in (("full", [full_url], "full", 0), ("agent", agent_urls, "auto", 40)):
        ws = type(cfg.weight_sync).model_validate({**cfg.weight_sync.model_dump(), "transfer": transfer,
                                                   "master_port": port + 100 + offset, "group_name": f"ws_{key}",
                                                   "bucket_timeout_s": 60.0, "group_timeout_s": 180.0})  # fmt: skip
        sync = _sync(learner, cfg.model_copy(update={"weight_sync": ws}), urls)
        out[key] = {"metrics": sync.push(1), "names": sorted(n for s in sync.plan.stages for n in s.hf_names)}
        sync.close()
    return out if dist.get_rank() == 0 else {}


@pytest.mark.parametrize(
    ("handover", "layout", "in_place"),
    [pytest.param("direct", {"tensor": 2}, False, marks=pytest.mark.slow),  # the local run through an agent: direct
     ("hf", {"tensor": 1}, True),  # engines that load in place, as SGLang's do: the agent pauses them to hand over
     pytest.param("direct", {"tensor": 2, "expert": 2, "pipeline": 2}, False, marks=pytest.mark.slow),
     pytest.param("hf", {"tensor": 2, "expert": 2, "pipeline": 2}, False, marks=pytest.mark.slow)],
    ids=["direct-tp2", "hf-tp1-in-place", "direct-tp2ep2pp2", "hf-tp2ep2pp2"],
)  # fmt: skip
def test_agents_hand_each_engine_rank_its_slice_and_the_engines_serve_what_a_full_push_serves(
    start_engine: Any, start_agent: Any, tiny_hf_dir: Any, handover: str, layout: dict[str, int], in_place: bool
) -> None:
    """A learner (TP2 x EP2 x PP2: 8 ranks; or one rank) into two TP=2 engines through their agents. direct: each
    agent rank received exactly its engine rank's blocks (<= 0.6 of the full bytes) and handed exactly those over;
    hf (SGLang's load_format None, here with --ep-size 1: every tensor whole). Either way both engines then hold,
    rank by rank, what the engine given a full push holds, and generate the same greedy tokens at the new version;
    the engines were never paused by the learner (the agent receives beside them), and only for the handover when
    they load in place (--load-in-place, SGLang's loading)."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    full = start_engine(hf_dir, "--tp-size", "2")
    engines = [start_engine(hf_dir, "--tp-size", "2", *(["--load-in-place"] if in_place else [])) for _ in range(2)]
    for e in (full, *engines):
        e.wait_healthy()
    agents = [start_agent(e.url, "--handover", handover) for e in engines]
    for a in agents:
        a.wait_healthy()
    world = layout.get("tensor", 1) * layout.get("expert", 1) * layout.get("pipeline", 1)
    out = spawn_ranks(_push, world, str(hf_dir), layout, full.url, [a.url for a in agents], find_free_port(),
                      timeout_s=900)[0]  # fmt: skip
    m = out["agent"]["metrics"]
    assert m["sync/failed"] == 0 and m["sync/sharded"] == 1.0, (m, _logs(agents))
    names = out["full"]["names"]
    whole = _expected_rank_bytes(str(hf_dir), names, {"tp_size": 2, "shards": {}}, torch.float32)
    reference = SGLangClient(full.url)
    want = [r["checksums"] for r in reference.weights_checksum()["ranks"]]
    tokens = reference.generate(PROMPT, {"max_new_tokens": 10, **GREEDY}).output_ids
    for agent, engine in zip(agents, engines):
        info = SGLangClient(agent.url).server_info()
        got = [sum(g["bytes"] for g in r["weight_update_groups"].values()) for r in info["tp_ranks"]]
        table = SGLangClient(agent.url).weight_shards()
        assert got == _expected_rank_bytes(str(hf_dir), names, table, torch.float32), got
        if handover == "direct":
            assert max(got) <= 0.6 * whole[0], (got, whole)
        else:
            assert got == whole
        assert info["handover"]["handovers"] == 1 and info["handover"]["partial"] is None, info["handover"]
        # a staging engine takes the handover beside its decoding; one that loads in place is paused for it
        assert (info["handover"]["engine_paused_s"] > 0.0) == in_place, info["handover"]
        client = SGLangClient(engine.url)
        handed = [r["weight_update_groups"]["update_weights_from_tensor"]["bytes"]
                  for r in client.server_info()["tp_ranks"]]  # fmt: skip
        assert handed == got, (handed, got)
        assert (client.server_info()["load"]["paused_s"] > 0.0) == in_place
        assert [r["checksums"] for r in client.weights_checksum()["ranks"]] == want
        gen = client.generate(PROMPT, {"max_new_tokens": 10, **GREEDY})
        assert gen.output_ids == tokens and gen.versions == [1] * 10


def _push_killed(hf_dir: str, url: str, port: int, agent_pid: int) -> dict[str, Any]:
    """One rank: a push through an agent that is SIGKILLed (all its ranks) as bucket 2 starts."""
    from megatron_sao.weight_sync import sender as sender_mod

    cfg, learner = _learner(hf_dir, {}, port, bucket_mb=0.02, bucket_timeout_s=20.0, group_timeout_s=90.0)
    sync = _sync(learner, cfg, [url])
    real_start = sender_mod.StageSender.start

    def start(self: Any, bucket: Any, buffer: torch.Tensor) -> Any:
        if bucket.index == 2:
            os.killpg(agent_pid, signal.SIGKILL)
            time.sleep(0.2)
        return real_start(self, bucket, buffer)

    sender_mod.StageSender.start = start  # type: ignore[method-assign]
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.mul_(1.5)
    metrics = sync.push(1)
    sync.close()
    return metrics


def test_an_agent_killed_mid_push_leaves_the_engine_as_it_was(
    start_engine: Any, start_agent: Any, tiny_hf_dir: Any
) -> None:
    """The engine never saw the push (the agent dies while receiving it): same weights, same version, and it
    generates as before; the learner reports the push failed."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    engine = start_engine(hf_dir)
    engine.wait_healthy()
    agent = start_agent(engine.url)
    agent.wait_healthy()
    client = SGLangClient(engine.url)
    before = client.weights_checksum()["ranks"][0]["per_gpu_checksum"]
    version = str(client.weight_version())
    tokens = client.generate(PROMPT, {"max_new_tokens": 8, **GREEDY}).output_ids
    (metrics,) = spawn_ranks(_push_killed, 1, str(hf_dir), agent.url, find_free_port(), agent.proc.pid,
                             timeout_s=300)  # fmt: skip
    assert metrics["sync/failed"] == 1.0, metrics
    assert agent.proc.wait(10) is not None
    assert client.weights_checksum()["ranks"][0]["per_gpu_checksum"] == before
    assert str(client.weight_version()) == version
    assert client.generate(PROMPT, {"max_new_tokens": 8, **GREEDY}).output_ids == tokens
