"""The embedded engine at --tp-size 2 (two processes over gloo, as SGLang runs one engine over two ranks): the same
greedy tokens and log-probs as at TP=1 for every supported family; a full-tensor push lands on both ranks (each
keeps its own elements) and the engine then serves exactly what a TP=1 engine pushed the same way serves; a push
refused on the way leaves both ranks as they were; a rank that dies takes the engine with it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines.client import SGLangClient
from tests.engines.pushes import in_thread, session_push, sharded_update, update

PROMPT = [3, 17, 29, 5, 11, 42, 7]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
pytestmark = pytest.mark.multiproc


def _generate(url: str) -> Any:
    return SGLangClient(url).generate(PROMPT, GREEDY)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("glm4_moe", marks=pytest.mark.slow), "glm_moe_dsa"])
def test_tp2_generates_the_tokens_and_logprobs_of_tp1(start_engine: Any, tiny_dirs: dict[str, Path],
                                                     family: str) -> None:  # fmt: skip
    one, two = start_engine(tiny_dirs[family]), start_engine(tiny_dirs[family], "--tp-size", "2")
    one.wait_healthy()
    two.wait_healthy()
    assert SGLangClient(two.url).server_info()["tp_size"] == 2
    a, b = _generate(one.url), _generate(two.url)
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_an_engine_over_two_nodes_generates_what_one_rank_does(start_engine: Any, tiny_dirs: dict[str, Path]) -> None:
    """Its ranks spread as SGLang spreads them over nodes (--nnodes 2 --node-rank --dist-init-addr), here two
    processes of one machine: node 0 serves HTTP, node 1 follows its commands; greedy tokens and log-probs equal a
    one-rank engine's. The slow tier runs it on the local Slurm cluster, taking pushes from a TP=2 x PP=2 learner
    (tests/launch/test_slurm.py)."""
    model = tiny_dirs["qwen3_moe"]
    spread = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{find_free_port()}")
    one, head = start_engine(model), start_engine(model, *spread, "--node-rank", "0")
    follower = start_engine(model, *spread, "--node-rank", "1")
    one.wait_healthy()
    head.wait_healthy()
    assert SGLangClient(head.url).server_info()["tp_size"] == 2
    a, b = _generate(one.url), _generate(head.url)
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert "engine TP rank 1 serving rank 0's commands" in follower.log_path.read_text()
    assert follower.proc.poll() is None


def _join(clients: list[SGLangClient], tp_sizes: list[int], port: int, name: str = "g",
          block_groups: list[list[int]] | None = None) -> Any:  # fmt: skip
    """The trainer side of an update group over engines of several ranks each: engine i's ranks are
    rank_offset_i .. rank_offset_i + tp_i - 1 (SGLang's rule), this process rank 0. With `block_groups`:
    (the group, the sub-group of each part, joined after it as the engines join theirs)."""
    from megatron_sao.distributed.update_group import host_store, init_update_group

    world = 1 + sum(tp_sizes)
    store, port = host_store("127.0.0.1", port, world, 120.0)
    box: dict[str, Any] = {}
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(clients))]
    threads = [in_thread(box, c.url, c.init_weights_update_group, "127.0.0.1", port, off, world, name, "gloo",
                         block_groups=block_groups) for c, off in zip(clients, offsets)]  # fmt: skip
    group = init_update_group("gloo", "127.0.0.1", port, world, 0, name, 120.0, store=store)
    blocks = [init_update_group("gloo", "127.0.0.1", port, len(part) + 1, 0, f"{name}/blocks{i}", 120.0, store=store)
              for i, part in enumerate(block_groups or [])]  # fmt: skip
    for t in threads:
        t.join(120)
    for c in clients:
        assert box[c.url]["success"], box[c.url]
    return (group, blocks) if block_groups is not None else group


def _perturbed(model_dir: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(5)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in weights.items()}


SHARDED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
           "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight",
           "model.layers.1.mlp.experts.3.down_proj.weight", "lm_head.weight", "model.embed_tokens.weight"]  # fmt: skip


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened"])
def test_a_push_lands_on_both_ranks_and_serves_what_tp1_serves(start_engine: Any, tiny_dirs: dict[str, Path],
                                                              flattened: bool) -> None:  # fmt: skip
    model = tiny_dirs["qwen3_moe_notok"]
    one, two = start_engine(model), start_engine(model, "--tp-size", "2")
    one.wait_healthy()
    two.wait_healthy()
    clients = [SGLangClient(one.url), SGLangClient(two.url)]
    before = _generate(two.url)
    new = _perturbed(model)
    name = f"tp-{'flat' if flattened else 'each'}"  # one name per group this test process ever forms
    group = _join(clients, [1, 2], find_free_port(), name)
    answers = session_push(clients, new, 7, group, flattened=flattened, group_name=name)
    for c in clients:
        assert answers[c.url]["update"]["success"] and answers[c.url]["end"]["success"], answers
    a, b = _generate(one.url), _generate(two.url)
    assert b.versions == [7] * 12 and b.output_ids != before.output_ids
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    info = clients[1].server_info()
    ranks = info["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    full = sum(t.nbytes for t in new.values())
    for r in ranks:  # full-tensor push: every rank received every byte (and kept its slice)
        assert r["weight_update_groups"][name]["bytes"] >= full, r
    for name in SHARDED:  # the rows of split weights, reassembled from both ranks, are what was pushed
        rows = clients[1].get_weights_by_name(name, truncate_size=3)
        assert torch.equal(torch.tensor(rows), new[name][:3].float()), name
    checks = clients[1].weights_checksum()
    assert [r["parallelism_info"][0]["tp_rank"] for r in checks["ranks"]] == [0, 1]
    tp1 = clients[0].weights_checksum()["ranks"][0]["checksums"]
    for held in (r["checksums"] for r in checks["ranks"]):
        assert held["model.norm.weight"] == tp1["model.norm.weight"]  # replicated: whole on every rank
        assert held["model.layers.0.self_attn.q_proj.weight"] != tp1["model.layers.0.self_attn.q_proj.weight"]


def test_a_refused_push_leaves_both_ranks_as_they_were(start_engine: Any, tiny_dirs: dict[str, Path]) -> None:
    model = tiny_dirs["qwen3_moe_notok"]
    two = start_engine(model, "--tp-size", "2")
    two.wait_healthy()
    client = SGLangClient(two.url)
    before = _generate(two.url)
    group = _join([client], [2], find_free_port(), name="h")
    client.begin_weight_update()
    new = _perturbed(model)
    bad_shape = {"model.layers.0.self_attn.q_proj.weight": [1, 1]}
    answers = update([client], new, group, group_name="h", version=9, declared_shapes=bad_shape)
    assert isinstance(answers[client.url], Exception) or not answers[client.url]["success"]
    with pytest.raises(Exception, match="discarded"):
        client.end_weight_update()
    after = _generate(two.url)
    assert after.output_ids == before.output_ids and after.versions == before.versions


def test_a_dead_rank_ends_the_engine(start_engine: Any, tiny_dirs: dict[str, Path]) -> None:
    two = start_engine(tiny_dirs["qwen3_moe_notok"], "--tp-size", "2")
    two.wait_healthy()
    children = psutil.Process(two.proc.pid).children()
    assert len(children) == 1, children
    children[0].kill()
    deadline = time.monotonic() + 30
    while two.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert two.proc.returncode == 1, "rank 0 outlived its TP peer"
    assert "exited" in two.log_path.read_text()


def test_a_sharded_push_sends_each_rank_its_block_and_serves_what_a_full_push_serves(
    start_engine: Any, tiny_dirs: dict[str, Path]
) -> None:
    """Two TP=2 engines: A takes new weights by a full-tensor broadcast; then both take them by
    load_format="sharded_bucket", rank r of both engines one block group (one broadcast of only rank r's blocks). B
    then holds what A held after the full push on every rank (per-rank checksums) and generates the same greedy
    tokens with exactly the same log-probs; each rank received its blocks and the replicated tensors, and no more."""
    model = tiny_dirs["qwen3_moe_notok"]
    full, sharded = start_engine(model, "--tp-size", "2"), start_engine(model, "--tp-size", "2")
    full.wait_healthy()
    sharded.wait_healthy()
    a, b = SGLangClient(full.url), SGLangClient(sharded.url)
    table = b.weight_shards()
    assert table["tp_size"] == 2
    q = table["shards"]["model.layers.0.self_attn.q_proj.weight"]  # column-split: each rank half the rows
    rows = _perturbed(model)["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert [box[0][0] for box in q] == [0, rows // 2] and all(box[1][0] == rows // 2 for box in q), q
    o = table["shards"]["model.layers.0.self_attn.o_proj.weight"]  # row-split: each rank half the columns
    assert o[0][0] == [0, 0] and o[1][0][0] == 0 and o[1][0][1] == o[0][1][1], o
    assert "model.norm.weight" not in table["shards"]  # replicated: sent whole to every rank
    new = _perturbed(model)
    ga = _join([a], [2], find_free_port(), name="shard-full")
    answers = session_push([a], new, 4, ga, flattened=True, group_name="shard-full")
    assert answers[a.url]["update"]["success"] and answers[a.url]["end"]["success"], answers
    held_full = [r["checksums"] for r in a.weights_checksum()["ranks"]]
    x = _generate(full.url)
    _, blocks = _join([a, b], [2, 2], find_free_port(), name="shard-each", block_groups=[[1, 3], [2, 4]])
    for c in (a, b):
        c.begin_weight_update()
    answers, sent, sent_sums = sharded_update([a, b], new, blocks, group_name="shard-each", version=5)
    for c in (a, b):
        assert not isinstance(answers[c.url], Exception) and answers[c.url]["success"], answers
        assert c.end_weight_update()["success"]
    whole = sum(t.nbytes for t in new.values())
    for c in (a, b):
        for r, got in zip(c.server_info()["tp_ranks"], sent):  # each rank's group carried what its block group got
            assert r["weight_update_groups"]["shard-each"]["bytes"] == got
    assert max(sent) <= 0.6 * whole, (sent, whole)
    for c in (a, b):
        held_sharded = [r["checksums"] for r in c.weights_checksum()["ranks"]]
        assert held_full == held_sharded
        for held, mine in zip(held_sharded, sent_sums):  # each rank hashes the blocks it holds: the ones it was sent
            assert all(held[n] == chk for n, chk in mine.items())
    y = _generate(sharded.url)
    assert x.output_ids == y.output_ids and x.logprobs == y.logprobs and y.versions == [5] * 12
