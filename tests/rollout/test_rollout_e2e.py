"""Stream rollout in miniature: a worker rolls out on two engine processes while a trainer process pushes new weights
to both (pause in place -> one gloo broadcast to both engines -> continue); trajectories in flight span versions."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron_sao.distributed.spawn import find_free_port, spawn_ranks
from megatron_sao.distributed.update_group import destroy_update_group
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineRouter, SGLangClient
from megatron_sao.models.tiny import build_tiny_tokenizer
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, ChatTemplateCodec
from megatron_sao.rollout.envs import make_env
from megatron_sao.rollout.prompts import PromptCursor
from megatron_sao.rollout.worker import InMemorySink, RolloutWorker, WorkerConfig
from tests.engines.pushes import join_group, session_push

VERSIONS = 3


def push_versions(urls: list[str], model_dir: str, port: int) -> list[str]:
    """Trainer (rank 0 of 1 + len(urls)): push VERSIONS updates, each while requests are in flight (pause in place,
    one session per push, continue)."""
    import torch
    from safetensors.torch import load_file

    clients = [SGLangClient(u) for u in urls]
    group = join_group(clients, port)
    base = load_file(f"{model_dir}/model.safetensors")
    messages = []
    for version in range(1, VERSIONS + 1):
        deadline = time.monotonic() + 60
        while not all(c.request("GET", P.SERVER_INFO)["load"]["num_running"] for c in clients):
            assert time.monotonic() < deadline, "engines never had requests in flight"
            time.sleep(0.01)
        for c in clients:
            c.pause_generation("in_place")
        new = {k: base[k] + 0.01 * version * torch.ones_like(base[k]) for k in sorted(base)}
        answers = session_push(clients, new, version, group, flattened=True)
        messages += [a["update"]["message"] for a in answers.values()]
        for c in clients:
            c.continue_generation()
        time.sleep(0.3)
    destroy_update_group(group)
    return messages


@pytest.mark.slow
@pytest.mark.multiproc
def test_worker_streams_while_weights_change_under_it(start_engine: Any, tiny_dirs: dict[str, Path]) -> None:
    engines = [start_engine(tiny_dirs["qwen3_moe"]) for _ in range(2)]
    for e in engines:
        e.wait_healthy()
    urls = [e.url for e in engines]
    tok = build_tiny_tokenizer()
    env = make_env("style_preference", {"period": 1})
    sampling = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    loop = AgentLoop(
        env, ChatTemplateCodec(tok), EngineRouter.from_urls(urls).generate, AgentLoopConfig(sampling=sampling)
    )
    sink = InMemorySink()
    worker = RolloutWorker(PromptCursor(env.make_prompts(400)), loop, sink, WorkerConfig(concurrency=8))
    stop = threading.Event()
    runner = threading.Thread(target=worker.run, kwargs={"stop": stop})
    runner.start()
    try:
        (messages,) = spawn_ranks(push_versions, 1, urls, str(tiny_dirs["qwen3_moe"]), find_free_port(), timeout_s=300)
    finally:
        stop.set()
        runner.join(120)
    assert len(messages) == 2 * VERSIONS and all("Weight version updated" in m for m in messages)
    trajs = sink.items
    assert len({t.header.prompt_id for t in trajs}) == len(trajs)  # each prompt once
    spanning = 0
    for t in trajs:
        v = t.weight_versions[t.action_mask]
        assert (np.diff(v) >= 0).all()  # versions never go back within a trajectory
        spanning += int(v.min() != v.max())
        assert t.header.metadata["style"] == env.active_style(int(v.max()))  # the reward in force when it finished
    assert spanning >= 2  # requests in flight at an update carry two versions
    assert {int(t.weight_versions[t.action_mask].max()) for t in trajs} >= {0, VERSIONS}
