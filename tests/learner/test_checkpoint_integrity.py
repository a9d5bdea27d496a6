"""Checkpoint integrity (learner/integrity.py): a checkpoint is complete or absent (written as a hidden partial
directory, renamed when done, with a checksum per file); flipped bytes, a truncated file, a damaged common.pt are
found at load and named; a damaged `latest` falls back to the newest intact checkpoint (saying so) or is refused
with the fix; a save cut by a crash or a full disk (ENOSPC, named) leaves nothing that blocks a later save."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import learner_config, on_policy


def _data_file(ckpt: Path) -> Path:
    return max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def _scenario(hf_dir: str, root: str, batches: list) -> dict:
    from megatron.core import dist_checkpointing

    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner import checkpoint as ck
    from megatron_sao.learner.learner import Learner

    root_p = Path(root)
    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]), "fp32")
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    out: dict = {}
    for batch in batches[:2]:
        learner.train_step(batch)
        ck.save_checkpoint(learner, root_p)
    out["listing"] = sorted(p.name for p in root_p.iterdir())
    out["has_checksums"] = (root_p / "iter_0000002" / "checksums.json").is_file()
    rank0 = int(os.environ["RANK"]) == 0

    def damage(path: Path, how: str) -> None:
        if rank0:
            data = bytearray(path.read_bytes())
            mid = len(data) // 2
            if how == "flip":
                data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
            else:
                data = data[:mid]
            path.write_bytes(bytes(data))
        import torch.distributed as dist

        dist.barrier()

    damage(_data_file(root_p / "iter_0000002"), "flip")
    fresh = Learner(cfg, layout=ctx)
    ck.load_checkpoint(fresh, root_p)
    out["fell_back_to"] = fresh.version
    out["after_fallback"] = sorted(p.name for p in root_p.iterdir())
    out["latest_after_fallback"] = (root_p / "latest").read_text().strip()
    fresh.train_step(batches[1])  # the run goes on from version 1 and saves version 2 again: nothing blocks it
    ck.save_checkpoint(fresh, root_p)
    out["resaved"] = sorted(p.name for p in root_p.iterdir())
    try:
        ck.load_checkpoint(Learner(cfg, layout=ctx), root_p / "iter_0000002.damaged")
    except ck.CheckpointError as e:
        out["direct"] = str(e)
    again = Learner(cfg, layout=ctx)  # learner.load names an older checkpoint of the same directory
    ck.load_checkpoint(again, root_p / "iter_0000001")
    again.train_step(batches[1])
    ck.save_checkpoint(again, root_p)
    out["abandoned"] = sorted(p.name for p in root_p.iterdir())
    damage(root_p / "iter_0000001" / "common.pt", "truncate")
    damage(_data_file(root_p / "iter_0000002"), "flip")
    try:
        ck.load_checkpoint(Learner(cfg, layout=ctx), root_p)
    except ck.CheckpointError as e:
        out["none_intact"] = str(e)

    # a cut save leaves a partial directory; the next save of that name replaces it
    if rank0:
        (root_p / ".iter_0000003.partial").mkdir()
        (root_p / ".iter_0000003.partial" / "junk").write_text("half a checkpoint")
    learner.train_step(batches[2])
    ck.save_checkpoint(learner, root_p)
    out["after_cut"] = sorted(p.name for p in root_p.iterdir())

    real_save = dist_checkpointing.save

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    dist_checkpointing.save = full_disk
    try:
        learner.train_step(batches[3])
        ck.save_checkpoint(learner, root_p)
    except ck.CheckpointError as e:
        out["enospc"] = str(e)
    finally:
        dist_checkpointing.save = real_save
    out["after_enospc"] = sorted(p.name for p in root_p.iterdir())
    out["latest"] = (root_p / "latest").read_text().strip()
    ck.save_checkpoint(learner, root_p)  # space back: the same version saves
    out["latest_after"] = (root_p / "latest").read_text().strip()
    destroy_distributed()
    return out


@pytest.mark.multiproc
def test_damaged_checkpoints_are_found_named_and_never_block(tiny_hf_dir, tmp_path: Path) -> None:
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    batches = [on_policy(make_batch(4, seed=s), hf_dir, seed=s) for s in (1, 2, 3, 4)]
    root = tmp_path / "ckpt"
    out = spawn_ranks(_scenario, 2, hf_dir, str(root), batches, timeout_s=600)[0]
    assert out["listing"] == ["iter_0000001", "iter_0000002", "latest"] and out["has_checksums"]
    assert out["fell_back_to"] == 1  # latest (iter 2) had flipped bytes: the newest intact one loads
    # the damaged one is kept aside, `latest` names what was loaded, and saving version 2 again just works
    assert out["after_fallback"] == ["iter_0000001", "iter_0000002.damaged", "latest"]
    assert out["latest_after_fallback"] == "iter_0000001"
    assert out["resaved"] == ["iter_0000001", "iter_0000002", "iter_0000002.damaged", "latest"]
    assert "iter_0000002.damaged" in out["direct"] and "does not match its checksum" in out["direct"]
    assert ".distcp" in out["direct"]
    # resumed from iter 1 with iter 2 present: the save of version 2 moves that one aside, never over it
    assert out["abandoned"] == ["iter_0000001", "iter_0000002", "iter_0000002.abandoned", "iter_0000002.damaged",
                                "latest"]  # fmt: skip
    assert "no intact checkpoint" in out["none_intact"] and "common.pt is truncated" in out["none_intact"]
    assert "learner.load" in out["none_intact"]
    assert out["after_cut"] == ["iter_0000001", "iter_0000002", "iter_0000002.abandoned", "iter_0000002.damaged",
                                "iter_0000003", "latest"]  # fmt: skip
    assert "no space left on" in out["enospc"] and "(learner.save_dir)" in out["enospc"]
    assert out["after_enospc"] == out["after_cut"] and out["latest"] == "iter_0000003"
    assert out["latest_after"] == "iter_0000004"


def test_a_save_failure_that_names_no_errno_on_a_full_disk_is_named_as_one(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer on a full disk says `unexpected pos 704 vs 598`, never ENOSPC: the free space decides."""
    from megatron_sao.learner import integrity

    where = tmp_path / "ckpt" / "iter_0000008"
    err = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    monkeypatch.setattr(integrity, "disk_nearly_full", lambda p: True)
    assert "no space left on" in integrity.describe_save_error(err, where)
    assert "(learner.save_dir)" in integrity.describe_save_error(err, where)
    monkeypatch.setattr(integrity, "disk_nearly_full", lambda p: False)
    assert integrity.describe_save_error(err, where).startswith(f"writing the checkpoint to {where} failed")
    chained = RuntimeError("write failed")
    chained.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert "no space left on" in integrity.describe_save_error(chained, where)
