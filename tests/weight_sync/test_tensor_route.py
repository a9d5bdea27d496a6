"""SGLang's /update_weights_from_tensor on the embedded engine (the route a per-node push agent hands each engine rank
its slice by): per-TP-rank payloads opened under SGLang's safe-unpickler rules, inside a weight-update session,
staged and committed at its end; a payload naming a global outside the allow-list, or outside a session, is refused
and changes nothing (distributed/tensor_payload.py, engines/embedded/weights.py receive_tensors)."""

from __future__ import annotations

import base64
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_sao.distributed import flat_bucket, tensor_payload
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineError, SGLangClient

pytestmark = pytest.mark.multiproc
PROMPT = [3, 17, 29, 5, 11]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _post(client: SGLangClient, body: dict[str, Any]) -> Any:
    try:
        return client.request("POST", P.UPDATE_WEIGHTS_FROM_TENSOR, body)
    except EngineError as e:
        return e


def _scaled_copy(hf_dir: Path, ref_dir: Path, factor: float) -> tuple[dict[str, torch.Tensor], Path]:
    """The model's weights times `factor`, and a copy of the model directory holding them (the reference engine's)."""
    shutil.copytree(hf_dir, ref_dir)
    new = {n: (t * factor).contiguous() for n, t in _weights(hf_dir).items()}
    for f in [*ref_dir.glob("*.safetensors"), *ref_dir.glob("*.safetensors.index.json")]:
        f.unlink()
    save_file(new, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    return new, ref_dir


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def test_a_tensor_route_push_lands_whole_and_a_foreign_global_or_a_missing_session_changes_nothing(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Path
) -> None:
    hf_dir = Path(tiny_hf_dir("qwen3_moe"))
    engine = start_engine(hf_dir)
    engine.wait_healthy()
    client = SGLangClient(engine.url)
    weights = _weights(hf_dir)
    before = client.weights_checksum()["ranks"][0]["per_gpu_checksum"]
    new = {n: t * 0.5 for n, t in weights.items()}
    entry = tensor_payload.pack(list(new.items()))  # shared memory: `new` stays alive through the call

    # outside a session: SGLang's refusal, nothing loaded
    refused = _post(client, {"serialized_named_tensors": [entry], "flush_cache": False})
    assert isinstance(refused, EngineError) and "must run between begin_weight_update()" in str(refused)

    # a payload naming os.system: blocked by the allow-list, the session fails, the model and version are as before
    client.begin_weight_update()
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", _Evil())])).decode()
    blocked = _post(client, {"serialized_named_tensors": [evil], "flush_cache": False, "weight_version": "9"})
    assert isinstance(blocked, EngineError) and "Blocked unsafe global (posix.system)" in str(blocked), blocked
    with pytest.raises(EngineError, match="session discarded, model unchanged"):
        client.end_weight_update()
    assert client.weights_checksum()["ranks"][0]["per_gpu_checksum"] == before
    assert str(client.weight_version()) != "9"

    # a whole push in two payloads (shared-memory and inline pickles), committed at the session's end
    client.begin_weight_update()
    names = list(new)
    half = len(names) // 2
    first = tensor_payload.pack([(n, new[n]) for n in names[:half]])
    second = tensor_payload.pack([(n, new[n]) for n in names[half:]], inline=True)
    for i, e in enumerate((first, second)):
        answer = client.update_weights_from_tensor([e], weight_version=7 if i else None, flush_cache=False)
        assert answer == {"success": True, "message": "Success"}, answer
    assert str(client.weight_version()) != "7"  # staged: nothing switches before the end
    client.end_weight_update()
    sent = flat_bucket.overall_checksum({n: flat_bucket.tensor_checksum(t) for n, t in new.items()})
    assert client.weights_checksum()["ranks"][0]["per_gpu_checksum"] == sent
    assert str(client.weight_version()) == "7"
    info = client.request("GET", P.SERVER_INFO)["weight_update_groups"]["update_weights_from_tensor"]
    assert info["tensors"] == len(names) and info["bytes"] == sum(t.nbytes for t in new.values())
    # it serves what an engine started from the same weights serves
    ref_dir = tmp_path / "halved"
    shutil.copytree(hf_dir, ref_dir)
    for f in [*ref_dir.glob("*.safetensors"), *ref_dir.glob("*.safetensors.index.json")]:
        f.unlink()
    halved = {n: t.contiguous() for n, t in new.items()}
    save_file(halved, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    reference = start_engine(ref_dir)
    reference.wait_healthy()
    tokens = client.generate(PROMPT, GREEDY).output_ids
    assert len(tokens) == 8 and tokens == SGLangClient(reference.url).generate(PROMPT, GREEDY).output_ids


def test_direct_payloads_give_each_tp_rank_its_block_and_serve_what_the_full_weights_serve(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Path
) -> None:
    """load_format "direct" at --tp-size 2: rank r's entry holds, under HF names, its /weight_shards block of each
    tensor it holds split and the others whole (what a per-node agent hands each engine rank); each rank receives
    exactly those bytes, and the engine then generates what a TP=1 engine loading the same weights generates."""
    hf_dir = Path(tiny_hf_dir("qwen3_moe"))
    two = start_engine(hf_dir, "--tp-size", "2")
    new, ref_dir = _scaled_copy(hf_dir, tmp_path / "scaled", 0.75)
    one = start_engine(ref_dir)
    two.wait_healthy()
    one.wait_healthy()
    client = SGLangClient(two.url)
    shards = client.weight_shards()["shards"]
    per_rank = [[(n, t if shards.get(n, [None, None])[r] is None else flat_bucket.block(t, shards[n][r]).contiguous())
                 for n, t in new.items()] for r in range(2)]  # fmt: skip
    assert any(shards.values()), "a TP=2 engine holds some tensors split"
    entries = [tensor_payload.pack(pairs) for pairs in per_rank]
    reference = SGLangClient(one.url).generate(PROMPT, GREEDY).output_ids
    assert client.generate(PROMPT, GREEDY).output_ids != reference, "the scaled weights must generate otherwise"
    client.begin_weight_update()
    client.update_weights_from_tensor(entries, load_format="direct", weight_version=5, flush_cache=False)
    client.end_weight_update()
    assert str(client.weight_version()) == "5"
    ranks = client.request("GET", P.SERVER_INFO)["tp_ranks"]
    got = [r["weight_update_groups"]["update_weights_from_tensor"]["bytes"] for r in ranks]
    assert got == [sum(t.nbytes for _, t in pairs) for pairs in per_rank]
    assert got[0] < sum(t.nbytes for t in new.values())  # each rank received its slice, not the model
    assert client.generate(PROMPT, GREEDY).output_ids == reference
    # a full tensor sent as "direct" to a rank that holds a block of it is refused before anything changes
    name = next(n for n, b in shards.items() if b[0] is not None)
    client.begin_weight_update()
    wrong = [tensor_payload.pack([(name, new[name])]) for _ in range(2)]
    with pytest.raises(EngineError, match="this rank's block"):
        client.update_weights_from_tensor(wrong, load_format="direct", flush_cache=False)
    with pytest.raises(EngineError, match="session discarded"):
        client.end_weight_update()
    assert client.generate(PROMPT, GREEDY).output_ids == reference


def test_an_engine_that_loads_in_place_serves_each_update_at_its_call_and_says_when_a_push_is_partial(
    start_engine: Any, tiny_hf_dir: Any, tmp_path: Path
) -> None:
    """--load-in-place (SGLang's loading, what the push agent's stall is measured against): at --tp-size 2 each
    rank loads its "direct" entry into the live model at the call, weights and version switch then, not at the
    session's end; clients learn it from /server_info (not staged: the agent pauses it for a handover and keeps it
    paused after a partial one); a push that fails after a part loaded leaves the engine partially updated, and says
    so, until a complete push lands."""
    hf_dir = Path(tiny_hf_dir("qwen3_moe"))
    two = start_engine(hf_dir, "--tp-size", "2", "--load-in-place")
    new, ref_dir = _scaled_copy(hf_dir, tmp_path / "scaled", 0.75)
    one = start_engine(ref_dir)
    two.wait_healthy()
    one.wait_healthy()
    client = SGLangClient(two.url)
    info = client.request("GET", P.SERVER_INFO)
    proto = P.ServerProtocol.from_server_info(info)
    assert info[P.LOADS_IN_PLACE_INFO] is True and proto.in_place and not proto.staged and not proto.deltas
    shards = client.weight_shards()["shards"]

    alive: list[Any] = []  # shared memory lives as long as its tensors: kept through the calls

    def entries(weights: dict[str, torch.Tensor], names: list[str]) -> list[str]:
        per_rank = [[(n, weights[n] if shards.get(n, [None, None])[r] is None
                      else flat_bucket.block(weights[n], shards[n][r]).contiguous()) for n in names]
                    for r in range(2)]  # fmt: skip
        alive.append(per_rank)
        return [tensor_payload.pack(pairs) for pairs in per_rank]

    start = client.generate(PROMPT, GREEDY).output_ids
    reference = SGLangClient(one.url).generate(PROMPT, GREEDY).output_ids
    assert start != reference
    client.begin_weight_update()
    client.update_weights_from_tensor(entries(new, list(new)), load_format="direct", weight_version=5,
                                      flush_cache=False)  # fmt: skip
    assert str(client.weight_version()) == "5"  # switched at the call, inside the session
    assert client.generate(PROMPT, GREEDY).output_ids == reference
    assert client.end_weight_update()["success"]
    ranks = client.request("GET", P.SERVER_INFO)["tp_ranks"]
    got = [r["weight_update_groups"]["update_weights_from_tensor"]["bytes"] for r in ranks]
    assert got[0] < sum(t.nbytes for t in new.values())  # each rank its slice
    # half a push loads, the next part is refused: the engine holds a mix and the session's end says so
    names = list(new)
    client.begin_weight_update()
    halved = {n: (t * 0.5).contiguous() for n, t in new.items()}
    client.update_weights_from_tensor(entries(halved, names[: len(names) // 2]), load_format="direct",
                                      flush_cache=False)  # fmt: skip
    split = next(n for n, b in shards.items() if b[0] is not None)
    with pytest.raises(EngineError, match="this rank's block"):
        client.update_weights_from_tensor([tensor_payload.pack([(split, new[split].clone())]) for _ in range(2)],
                                          load_format="direct", flush_cache=False)  # fmt: skip
    with pytest.raises(EngineError, match="partially updated"):
        client.end_weight_update()
    assert client.generate(PROMPT, GREEDY).output_ids != reference
    client.begin_weight_update()
    client.update_weights_from_tensor(entries(new, names), load_format="direct", weight_version=6, flush_cache=False)
    client.end_weight_update()
    assert client.generate(PROMPT, GREEDY).output_ids == reference and str(client.weight_version()) == "6"
