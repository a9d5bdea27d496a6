"""The learner's policy reaches the engines exactly: export at TP/EP/PP layouts reproduces the HF tensors, and a
push through WeightBroadcaster lands bit-exact in a running embedded engine with the new version; a push the
engine refuses leaves it unchanged, raises WeightSyncError naming the tensor, and the next push reconnects."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from tests.learner.test_learner_step import learner_config


def _export(hf_dir: str, layout: dict[str, int]) -> dict[str, torch.Tensor]:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.weight_sync.export import hf_dtype_of, iter_hf_weights

    cfg = learner_config(hf_dir, layout, int(os.environ["WORLD_SIZE"]))
    init_distributed(cfg.parallel, seed=3)
    learner = Learner(cfg, roles={"policy"})
    learner.load_hf(hf_dir)
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32)
    return dict(iter_hf_weights(learner.policy.model, learner.spec, dtype_of, chunk_bytes=20_000))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen3_moe", {"tensor": 2}), ("glm4_moe", {"pipeline": 2}), ("glm_moe_dsa", {"expert": 2})],
)
def test_export_reproduces_the_hf_checkpoint_at_every_layout(tiny_hf_dir: Any, family: str, layout: dict) -> None:
    from megatron_sao.models.builder import ModelSpec
    from megatron_sao.models.weights import TIED_LM_HEAD, HFCheckpoint, is_passthrough

    hf_dir = str(tiny_hf_dir(family))
    per_rank = spawn_ranks(_export, 2, hf_dir, layout, timeout_s=300)
    assert per_rank[1] == {}, "only rank 0 yields"
    got = per_rank[0]
    hf, spec = HFCheckpoint(hf_dir), ModelSpec.from_hf_dir(hf_dir)
    # every tensor the megatron model holds; not the ones it carries unchanged (DSA indexer, MTP), nor a tied
    # lm_head (the engine ties it to the embedding it receives)
    want = {n for n in hf.names() if not is_passthrough(spec, n)} - ({TIED_LM_HEAD} if spec.tie_embeddings else set())
    assert set(got) == want
    for name, tensor in got.items():
        ref = hf.get(name)
        assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, name
        assert torch.equal(tensor, ref), name


def _push_to_engine(url: str, hf_dir: str, port: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from megatron_sao.config.weight_sync import WeightSyncConfig
    from megatron_sao.rollout.client import SGLangClient
    from megatron_sao.weight_sync import WeightBroadcaster, WeightSyncError

    client = SGLangClient(url)
    base = load_file(f"{hf_dir}/model.safetensors")
    torch.manual_seed(0)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
    cfg = WeightSyncConfig(backend="gloo", master_port=port, bucket_mb=0.1)
    bc = WeightBroadcaster(cfg, [url], timeout_s=120)
    out: dict[str, Any] = {"stats": bc.push(iter(new.items()), version=5), "v5": client.weight_version()}
    names = sorted(new)
    out["exact"] = all(
        torch.equal(torch.tensor(client.get_weights_by_name(n, truncate_size=4)), new[n][:4].float()) for n in names
    )
    bad = dict(new)
    first = names[0]
    bad[first] = torch.zeros(new[first].shape[0] + 1, *new[first].shape[1:])
    try:
        bc.push(iter({k: v * 2 if k != first else v for k, v in bad.items()}.items()), version=6)
        out["refused"] = None
    except WeightSyncError as e:
        out["refused"] = str(e)
    out["v_after_refusal"] = client.weight_version()
    out["unchanged"] = all(
        torch.equal(torch.tensor(client.get_weights_by_name(n, truncate_size=4)), new[n][:4].float()) for n in names
    )
    again = {k: v * 0.5 for k, v in new.items()}
    bc.push(iter(again.items()), version=7)  # reconnects on the next port
    out["v7"] = client.weight_version()
    out["attempt"] = bc.attempt
    out["exact_again"] = all(
        torch.equal(torch.tensor(client.get_weights_by_name(n, truncate_size=4)), again[n][:4].float()) for n in names
    )
    bc.close()
    return out


@pytest.mark.multiproc
def test_push_lands_exactly_and_a_refused_push_changes_nothing(start_engine: Any, tiny_hf_dir: Any) -> None:
    from megatron_sao.distributed.spawn import find_free_port

    hf_dir = tiny_hf_dir("qwen3_moe")
    engine = start_engine(hf_dir)
    engine.wait_healthy()
    (out,) = spawn_ranks(_push_to_engine, 1, engine.url, str(hf_dir), find_free_port(), timeout_s=300)
    assert out["stats"]["sync/buckets"] >= 2 and out["stats"]["sync/version"] == 5.0  # 0.1 MB buckets split it
    assert out["v5"] == 5 and out["exact"]
    assert out["refused"] is not None and "shape" in out["refused"], out["refused"]
    assert out["v_after_refusal"] == 5 and out["unchanged"]
    assert out["v7"] == 7 and out["exact_again"] and out["attempt"] == 1


def _group_member(port: int) -> list[float]:
    import torch.distributed as dist

    from megatron_sao.distributed.update_group import destroy_update_group, init_update_group

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # what torchrun sets in the learner's ranks
    rank = int(os.environ["RANK"])
    group = init_update_group("gloo", "127.0.0.1", port, 2, rank, "sync_test", 60.0)
    t = torch.arange(3, dtype=torch.float32) * (7.0 if rank == 0 else 0.0)
    dist.broadcast(t, src=0, group=group)
    destroy_update_group(group)
    return t.tolist()


@pytest.mark.multiproc
def test_update_group_forms_under_torchrun() -> None:
    """Under torchrun, torch's tcp:// rendezvous makes rank 0 a client of the elastic agent's store: the learner's
    rank 0 must still host the update group's store (the trainer hung 300 s before)."""
    from megatron_sao.distributed.spawn import find_free_port

    assert spawn_ranks(_group_member, 2, find_free_port(), timeout_s=120) == [[0.0, 7.0, 14.0]] * 2
