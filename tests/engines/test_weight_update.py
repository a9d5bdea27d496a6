"""The embedded engine's side of SGLang's weight push, driven by a hand-rolled gloo trainer (tests/engines/pushes.py):
a session's updates are staged and switch weights and version together at `end`, in the middle of a generation; what
SGLang refuses before receiving is refused before receiving; a push refused or cut at any update leaves the served
weights and version untouched; flattened buckets and checksums match the trainer's bytes; the older releases' rules
(no session, a refused flush that kills the scheduler) are followed when emulated."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import flat_bucket
from megatron_sao.distributed.spawn import find_free_port, spawn_ranks
from megatron_sao.distributed.update_group import destroy_update_group
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineError, SGLangClient
from tests.engines.pushes import in_thread, join_group, session_push, update

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [1, 2, 3, 4]
PROBE = "model.layers.1.mlp.experts.2.up_proj.weight"  # an expert half: resolved into the fused in-memory tensor


def _reference(model_dir: str, tensors: dict[str, Any], prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of output under transformers loading `tensors` as an HF checkpoint (the trainer's view)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        shutil.copy(Path(model_dir) / "config.json", d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(d) / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def _rows(client: SGLangClient, name: str) -> torch.Tensor:
    return torch.tensor(client.get_weights_by_name(name, truncate_size=3))


def _wait_generating(client: SGLangClient, tokens: int) -> None:
    deadline = time.monotonic() + 60
    while client.request("GET", P.SERVER_INFO)["load"]["generated_tokens"] < tokens:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def trainer(engine_url: str, model_dir: str, port: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    client = SGLangClient(engine_url)
    box: dict[str, Any] = {}
    gen = in_thread(box, "long", client.generate, PROMPT, {"max_new_tokens": 160, **GREEDY})
    _wait_generating(client, 20)
    group = join_group([client], port)
    torch.manual_seed(0)
    base = load_file(f"{model_dir}/model.safetensors")
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in base.items()}
    names = sorted(new)
    half = len(names) // 2
    out: dict[str, Any] = {}
    # a session of two updates: nothing changes at the first; both land, with the version, at end
    client.begin_weight_update()
    out["first"] = update([client], {n: new[n] for n in names[:half]}, group)[client.url]
    out["staged_invisible"] = torch.equal(_rows(client, names[0]), base[names[0]][:3].float())
    out["version_before_end"] = client.weight_version()
    out["second"] = update([client], {n: new[n] for n in names[half:]}, group, version=1, flattened=True)[client.url]
    out["end"] = client.end_weight_update()
    gen.join(120)
    out["long"] = box["long"]
    out["after"] = client.generate(PROMPT, {"max_new_tokens": 8, **GREEDY})
    out["reference"] = _reference(model_dir, new, PROMPT, out["after"].output_ids)
    out["exact"] = all(torch.equal(_rows(client, n), new[n][:3].float()) for n in names)
    # an update outside a session is refused before anything is received; the group stays in step
    out["outside"] = update([client], {names[0]: new[names[0]] * 2}, group, version=9, send=False)[client.url]
    # refused at the LAST update of a session (a shape the model does not have): nothing of the session lands
    bad = {PROBE: [int(new[PROBE].shape[0]) + 1, int(new[PROBE].shape[1])]}
    client.begin_weight_update()
    out["ok_part"] = update([client], {n: new[n] * 3 for n in names[:half]}, group)[client.url]
    out["refused"] = update([client], {n: new[n] * 3 for n in names[half:]}, group, version=2,
                            declared_shapes=bad)[client.url]  # fmt: skip
    out["end_refused"] = in_thread(box, "end", client.end_weight_update).join(60) or box["end"]
    out["unchanged"] = all(torch.equal(_rows(client, n), new[n][:3].float()) for n in names)
    out["v_after_refusal"] = client.weight_version()
    # a misaligned flattened bucket is refused before receiving (SGLang's FlattenedTensorBucket.empty)
    odd = {"model.norm.weight": new["model.norm.weight"][:1].to(torch.bfloat16), names[1]: new[names[1]]}
    client.begin_weight_update()
    out["misaligned"] = _misaligned(client, odd)
    out["end_misaligned"] = in_thread(box, "end1", client.end_weight_update).join(60) or box["end1"]
    # announced as half its rows (per tensor and as a flat bucket) or as bf16, broadcast whole in fp32: drained and
    # refused (gloo ends a process whose posted buffer a message outgrows)
    client.begin_weight_update()
    halves = {PROBE: [int(new[PROBE].shape[0]) // 2, int(new[PROBE].shape[1])]}
    whole = {PROBE: new[PROBE] * 5, names[0]: new[names[0]] * 5}
    out["half"] = [update([client], whole, group, flattened=flat, declared_shapes=halves,
                          send_declared=False)[client.url] for flat in (False, True)]  # fmt: skip
    out["half"].append(
        update([client], whole, group, declared_dtypes={PROBE: torch.bfloat16}, send_declared=False)[client.url]
    )  # fp32 sent as announced bf16: half the bytes
    out["end_half"] = in_thread(box, "end3", client.end_weight_update).join(60) or box["end3"]
    out["unchanged_after_half"] = all(torch.equal(_rows(client, n), new[n][:3].float()) for n in names)
    # cut in the middle: the trainer goes away after the first of three updates (its group is torn down)
    client.begin_weight_update()
    update([client], {n: new[n] * 4 for n in names[:half]}, group)
    client.destroy_weights_update_group("g")
    destroy_update_group(group)
    out["end_after_cut"] = in_thread(box, "end2", client.end_weight_update).join(60) or box["end2"]
    out["unchanged_after_cut"] = all(torch.equal(_rows(client, n), new[n][:3].float()) for n in names)
    out["v_after_cut"] = client.weight_version()
    # a new connection pushes a complete session again; the checksum matches the trainer's bytes
    group = join_group([client], find_free_port(), name="g2")
    again = {k: v * 0.5 for k, v in new.items()}
    out["again"] = session_push([client], again, 3, group, group_name="g2", flattened=True)[client.url]
    out["v_again"] = client.weight_version()
    # weight_commits counts what was applied: the first session and this one; nothing refused, misaligned or cut
    out["commits"] = client.server_info()[P.WEIGHT_COMMITS_INFO]
    mine = flat_bucket.overall_checksum({n: flat_bucket.tensor_checksum(t) for n, t in again.items()})
    out["checksum"] = (client.weights_checksum()["ranks"][0]["per_gpu_checksum"], mine)
    out["traffic"] = client.request("GET", P.SERVER_INFO)["weight_update_groups"]["g2"]
    destroy_update_group(group)
    return out


def _misaligned(client: SGLangClient, tensors: dict[str, torch.Tensor]) -> Any:
    """A flattened bucket with a bf16 [1] tensor before an fp32 one: the fp32 offset (2 bytes) is unaligned."""
    names = list(tensors)
    try:
        return client.update_weights_from_distributed(
            names, [flat_bucket.dtype_name(tensors[n].dtype) for n in names], [list(tensors[n].shape) for n in names],
            group_name="g", flush_cache=False, load_format="flattened_bucket")  # fmt: skip
    except EngineError as e:
        return e


@pytest.mark.multiproc
def test_session_push_is_staged_atomic_and_switches_mid_generation(start_engine: Any, tiny_dirs: Any) -> None:
    engine = start_engine(tiny_dirs["qwen3_moe"])
    engine.wait_healthy()
    port = find_free_port()
    (out,) = spawn_ranks(trainer, 1, engine.url, str(tiny_dirs["qwen3_moe"]), port, timeout_s=400)
    assert out["first"]["success"] and out["second"]["success"] and out["end"]["success"], out
    assert out["staged_invisible"] and out["version_before_end"] == 0, "a staged update must not be served"
    long = out["long"]
    assert len(long.output_ids) == 160 and long.finish_type == "length"
    switch = long.versions.index(1)  # tokens in flight across the push carry two versions, switched at one step
    assert switch >= 20 and long.versions == [0] * switch + [1] * (160 - switch)
    assert out["after"].versions == [1] * 8 and out["exact"]
    assert max(abs(a - b) for a, b in zip(out["after"].logprobs, out["reference"])) <= 1e-4
    assert isinstance(out["outside"], EngineError) and out["outside"].status == 400
    assert "must run between begin_weight_update() and end_weight_update()" in str(out["outside"])
    assert out["ok_part"]["success"]
    assert isinstance(out["refused"], EngineError) and "up_proj" in str(out["refused"])
    assert isinstance(out["end_refused"], EngineError) and "discarded" in str(out["end_refused"])
    assert out["unchanged"] and out["v_after_refusal"] == 1, "a refused last update must leave the session unapplied"
    assert isinstance(out["misaligned"], EngineError) and "Unaligned" in str(out["misaligned"])
    # an update refused before receiving fails its session too: what the session staged otherwise never commits
    assert isinstance(out["end_misaligned"], EngineError) and "Unaligned" in str(out["end_misaligned"])
    assert all(isinstance(a, EngineError) and a.status == 400 and "up_proj" in str(a) for a in out["half"]), out
    assert isinstance(out["end_half"], EngineError) and out["unchanged_after_half"]
    assert isinstance(out["end_after_cut"], EngineError) and "no weight-update session" in str(out["end_after_cut"])
    assert out["unchanged_after_cut"] and out["v_after_cut"] == 1, "a cut push must leave the weights untouched"
    assert out["again"]["update"]["success"] and out["again"]["end"]["success"] and out["v_again"] == 3
    assert out["checksum"][0] == out["checksum"][1]
    assert out["traffic"]["tensors"] == len(out["traffic"]["names"]) > 0
    assert out["commits"] == 2


def legacy_trainer(engine_url: str, model_dir: str, port: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    client = SGLangClient(engine_url)
    out: dict[str, Any] = {"protocol": client.protocol()}
    try:
        client.begin_weight_update()
    except EngineError as e:
        out["begin"] = e.status
    group = join_group([client], port)
    new = {k: v * 1.5 for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    name = "model.norm.weight"
    out["applied"] = update([client], {name: new[name]}, group, version=4)[client.url]  # no session: applied at once
    out["exact"] = torch.equal(_rows(client, name), new[name][:3].float()) and client.weight_version() == 4
    box: dict[str, Any] = {}
    in_thread(box, "gen", client.generate, PROMPT, {"max_new_tokens": 400, **GREEDY})
    _wait_generating(client, 5)
    client.pause_generation("in_place")  # the request stays running with its KV: a flush must be refused
    names = [name]
    reply = in_thread(box, "crash", client.update_weights_from_distributed, names, ["float32"],
                      [list(new[name].shape)], group_name="g", weight_version=5, flush_cache=True)  # fmt: skip
    torch.distributed.broadcast(new[name] * 2, src=0, group=group)
    reply.join(60)
    out["crash"] = box["crash"]
    return out


@pytest.mark.multiproc
def test_sglang_0_5_10_rules_no_session_and_a_refused_flush_kills_the_server(start_engine: Any, tiny_dirs: Any) -> None:
    """Emulating 0.5.10: no session routes, each update applied on arrival, and a flush refused while a request runs
    ends the server (SGLang's scheduler asserts "Cache flush failed after updating weights")."""
    engine = start_engine(tiny_dirs["qwen3_moe"], "--emulate-sglang", "0.5.10")
    engine.wait_healthy()
    (out,) = spawn_ranks(legacy_trainer, 1, engine.url, str(tiny_dirs["qwen3_moe"]), find_free_port(), timeout_s=200)
    assert out["protocol"].version == "0.5.10" and not out["protocol"].session
    assert out["begin"] == 404 and out["applied"]["success"] and out["exact"]
    assert not isinstance(out["crash"], dict), "the engine answered a flush SGLang 0.5.10 dies on"
    engine.proc.wait(timeout=30)
    assert engine.proc.returncode != 0 and "Cache flush failed after updating weights" in engine.log_path.read_text()


def flush_trainer(engine_url: str, model_dir: str, port: int) -> Any:
    from safetensors.torch import load_file

    client = SGLangClient(engine_url)
    group = join_group([client], port)
    new = {k: v * 1.5 for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    box: dict[str, Any] = {}
    in_thread(box, "gen", client.generate, PROMPT, {"max_new_tokens": 400, **GREEDY})
    _wait_generating(client, 5)
    client.pause_generation("in_place")
    client.begin_weight_update()
    name = "model.norm.weight"
    reply = in_thread(box, "flush", client.update_weights_from_distributed, [name], ["float32"],
                      [list(new[name].shape)], group_name="g", weight_version=5, flush_cache=True)  # fmt: skip
    torch.distributed.broadcast(new[name], src=0, group=group)
    reply.join(60)
    try:
        client.end_weight_update()
        end = "committed"
    except EngineError as e:
        end = str(e)
    client.continue_generation()
    return {"flush": box["flush"], "end": end, "version": client.weight_version(), "alive": client.health()}


@pytest.mark.multiproc
def test_a_refused_flush_fails_the_update_and_the_session_from_0_5_22(start_engine: Any, tiny_dirs: Any) -> None:
    engine = start_engine(tiny_dirs["qwen3_moe"], "--emulate-sglang", "0.5.22")
    engine.wait_healthy()
    (out,) = spawn_ranks(flush_trainer, 1, engine.url, str(tiny_dirs["qwen3_moe"]), find_free_port(), timeout_s=200)
    assert isinstance(out["flush"], EngineError) and "cache was not flushed" in str(out["flush"])
    assert "discarded" in out["end"] and out["version"] == 0 and out["alive"]


def slow_trainer(engine_url: str, model_dir: str, port: int) -> dict[str, Any]:
    """One update of a session takes longer to arrive than the engine's idle-session timeout (1 s): the session
    is not idle while it receives, so the update is staged in it and lands, with the version, only at end."""
    from safetensors.torch import load_file

    client = SGLangClient(engine_url)
    group = join_group([client], port)
    base = load_file(f"{model_dir}/model.safetensors")
    name = "model.norm.weight"
    client.begin_weight_update()
    box: dict[str, Any] = {}
    reply = in_thread(box, "update", client.update_weights_from_distributed, [name], ["float32"],
                      [list(base[name].shape)], group_name="g", weight_version=7, flush_cache=False)  # fmt: skip
    deadline = time.monotonic() + 60
    while client.request("GET", P.SERVER_INFO)["weight_update_groups"]["g"]["receiving"] < 1:
        assert time.monotonic() < deadline, "the engine never started receiving"
        time.sleep(0.01)
    time.sleep(3.0)  # the session watcher looks every second; the session's timeout is 1 s
    torch.distributed.broadcast(base[name] * 3, src=0, group=group)
    reply.join(60)
    out = {"update": box["update"], "before_end": _rows(client, name), "base": base[name][:3].float(),
           "version_before_end": client.weight_version()}  # fmt: skip
    try:
        out["end"] = client.end_weight_update()
    except EngineError as e:
        out["end"] = e
    out["after_end"], out["version"] = _rows(client, name), client.weight_version()
    destroy_update_group(group)
    return out


@pytest.mark.multiproc
def test_an_update_receiving_past_the_idle_timeout_is_staged_in_its_session_not_applied_live(
    start_engine: Any, tiny_dirs: Any
) -> None:
    """Before: the session expired mid-receive and the update, finding no session, was applied to the live model."""
    engine = start_engine(tiny_dirs["qwen3_moe"], "--weight-session-timeout", "1")
    engine.wait_healthy()
    (out,) = spawn_ranks(slow_trainer, 1, engine.url, str(tiny_dirs["qwen3_moe"]), find_free_port(), timeout_s=200)
    assert isinstance(out["update"], dict) and out["update"]["success"], out["update"]
    assert torch.equal(out["before_end"], out["base"]) and out["version_before_end"] == 0, "applied before end"
    assert isinstance(out["end"], dict) and out["end"]["success"], out["end"]
    assert torch.equal(out["after_end"], out["base"] * 3) and out["version"] == 7


def test_an_end_that_wins_the_lock_over_an_announced_update_refuses_the_session() -> None:
    """An update announced to a session waits for the engine's one-at-a-time lock; an end_weight_update that gets the
    lock first must not commit what the session staged so far (it would be half a push)."""
    import threading

    from megatron_sao.engines.embedded.weights import WeightUpdateError, WeightUpdater

    updater = WeightUpdater(torch.nn.Linear(2, 2), P.ServerProtocol("0.5.23", embedded=True))
    updater.begin()
    updater.serial.acquire()  # another request holds the lock
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=_catch(updater.receive, ["weight"], ["float32"], [[2, 2]],
                                                            "g", None)), daemon=True)  # fmt: skip
    t.start()
    deadline = time.monotonic() + 10
    while updater.session is not None and updater.session.receiving < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(WeightUpdateError, match="still receiving"):
        updater._end()  # as if end had won the lock
    updater.serial.release()
    t.join(10)
    assert isinstance(box["r"], WeightUpdateError)  # the update finds its session gone: nothing applied


def _catch(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        return e


def test_a_sharded_bucket_needs_the_rank_s_block_group_and_block_groups_must_hold_it() -> None:
    """load_format sharded_bucket over a group joined without block_groups is refused before anything is received
    (the trainer's broadcast would go to a sub-group this rank never joined); block_groups that are not a partition
    of the group's engine ranks, or leave this rank out, are refused at join, naming the field."""
    from megatron_sao.engines.embedded.weights import WeightUpdateError, WeightUpdater, _block_part

    updater = WeightUpdater(torch.nn.Linear(2, 2), P.ServerProtocol("0.5.23", embedded=True))
    updater.groups["g"] = object()  # joined without block groups
    updater.begin()
    with pytest.raises(WeightUpdateError, match="without block_groups"):
        updater.receive(["weight"], ["float32"], [[2, 2]], "g", None, load_format="sharded_bucket")
    assert _block_part([[1, 3], [2, 4]], 3, 5) == (0, [1, 3])
    assert _block_part([[1, 3], [2, 4]], 4, 5) == (1, [2, 4])
    for bad, match in (([[1, 3], [3, 4]], "at most once"), ([[0, 1]], "at most once"), ([[1, 5]], "at most once"),
                       ([[1], []], "non-empty lists"), ("1,2", "non-empty lists"), ([[True]], "non-empty lists"),
                       ([[1], [2]], "does not hold this engine's rank 3")):  # fmt: skip
        with pytest.raises(WeightUpdateError, match=match):
            _block_part(bad, 3, 5)
