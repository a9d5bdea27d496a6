"""In-place weight updates through /init_weights_update_group + /update_weights_from_distributed with a real gloo
broadcast from a trainer process (rank 0) to an embedded engine process (rank 1), in the middle of a generation."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port, spawn_ranks
from megatron_sao.rollout import protocol as P
from megatron_sao.rollout.client import EngineError, SGLangClient
from megatron_sao.weight_sync.group import destroy_update_group, init_update_group

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [1, 2, 3, 4]


def _in_thread(box: dict[str, Any], key: str, fn: Any, *args: Any, **kwargs: Any) -> threading.Thread:
    def target() -> None:
        try:
            box[key] = fn(*args, **kwargs)
        except Exception as e:
            box[key] = e

    t = threading.Thread(target=target)
    t.start()
    return t


def _push(client: SGLangClient, tensors: dict[str, Any], version: int, group: Any,
          shapes: dict[str, list[int]] | None = None):  # fmt: skip
    """Announce `tensors` (optionally with wrong declared shapes) and broadcast them from rank 0 in order."""
    import torch
    import torch.distributed as dist

    names = sorted(tensors)
    shapes = shapes or {}
    declared = [shapes.get(n, list(tensors[n].shape)) for n in names]
    dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
    box: dict[str, Any] = {}
    t = _in_thread(box, "r", client.update_weights_from_distributed, names, dtypes, declared, group_name="g",
                   weight_version=version)  # fmt: skip
    for name, shape in zip(names, declared):
        wrong = name in shapes  # the trainer sends what it declared; the engine must drain it and refuse
        sent = torch.zeros(shape, dtype=tensors[name].dtype) if wrong else tensors[name].contiguous()
        dist.broadcast(sent, src=0, group=group)
    t.join(120)
    return box["r"]


def _reference(model_dir: str, tensors: dict[str, Any], prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of output under transformers loading `tensors` as an HF checkpoint (the trainer's view)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        shutil.copy(Path(model_dir) / "config.json", d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(d) / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def trainer(engine_url: str, model_dir: str, port: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    client = SGLangClient(engine_url)
    box: dict[str, Any] = {}
    gen = _in_thread(box, "long", client.generate, PROMPT, {"max_new_tokens": 160, **GREEDY})
    deadline = time.monotonic() + 60
    while client.request("GET", P.SERVER_INFO)["load"]["generated_tokens"] < 20:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    init = _in_thread(box, "init", client.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", "gloo")
    group = init_update_group("gloo", "127.0.0.1", port, 2, 0, "g", 120.0)  # as the engine builds its side
    init.join(120)
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    update = _push(client, new, version=1, group=group)
    gen.join(120)
    after = client.generate(PROMPT, {"max_new_tokens": 8, **GREEDY})
    bad_name = "model.layers.1.mlp.experts.2.up_proj.weight"
    wrong = {bad_name: [int(new[bad_name].shape[0]) + 1, int(new[bad_name].shape[1])]}
    rejected = _push(client, {k: v * 3 for k, v in new.items()}, version=2, group=group, shapes=wrong)
    unchanged = client.generate(PROMPT, {"max_new_tokens": 8, **GREEDY})
    again = _push(client, new, version=3, group=group)  # the group is still in step after the drained, rejected update
    out = {
        "init": box["init"], "update": update, "long": box["long"], "after": after, "rejected": rejected,
        "unchanged": unchanged, "again": again, "version": client.weight_version(),
        "reference": _reference(model_dir, new, PROMPT, after.output_ids),
    }  # fmt: skip
    destroy_update_group(group)
    return out


@pytest.mark.multiproc
def test_update_mid_generation_gives_two_versions_and_exact_new_weights(start_engine: Any, tiny_dirs: Any) -> None:
    engine = start_engine(tiny_dirs["qwen3_moe"])
    engine.wait_healthy()
    (out,) = spawn_ranks(trainer, 1, engine.url, str(tiny_dirs["qwen3_moe"]), find_free_port(), timeout_s=300)
    for key in ("init", "update", "again"):
        assert not isinstance(out[key], BaseException), out[key]
        assert out[key]["success"], out[key]
    long = out["long"]
    assert len(long.output_ids) == 160 and long.finish_type == "length"
    assert set(long.versions) == {0, 1}, "the in-flight request should carry both weight versions"
    switch = long.versions.index(1)
    assert switch >= 20 and long.versions == [0] * switch + [1] * (160 - switch)
    assert out["after"].versions == [1] * 8
    assert max(abs(a - b) for a, b in zip(out["after"].logprobs, out["reference"])) <= 1e-4
    assert isinstance(out["rejected"], EngineError) and out["rejected"].status == 400
    assert "up_proj" in str(out["rejected"]) and "model unchanged" in str(out["rejected"])
    assert out["unchanged"].output_ids == out["after"].output_ids and out["unchanged"].versions == [1] * 8
    assert out["version"] == 3
