"""Checkpoint integrity (used by learner/checkpoint.py): a checkpoint is written into a hidden partial directory,
every file's size and CRC-32 go into its `checksums.json`, and only then is it renamed into place -- so a directory
named iter_N is always complete, and a save cut by a crash or a full disk leaves only a `.iter_N.partial` that the
next save of that name removes. Loading verifies the sizes and checksums first (the files spread over the ranks)
and names the first bad file; a save_dir whose `latest` is damaged falls back to its newest intact checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import zlib
from pathlib import Path

from megatron_sao.distributed.collectives import all_gather_object, share, world_position
from megatron_sao.files import is_disk_full, no_space

log = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
CHUNK = 8 << 20


def partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def crc32_of(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def _mine(items: list[Path]) -> list[Path]:
    """This rank's share of `items` (round robin), so a large checkpoint is hashed by all ranks at once."""
    rank, world = world_position()
    return items[rank::world]


def write_checksums(root: Path) -> None:
    """Collective: every rank hashes its share of root's files; rank 0 writes root/checksums.json."""
    rank0 = world_position()[0] == 0
    files = share(_files(root) if rank0 else [])
    mine = {str(p.relative_to(root)): [p.stat().st_size, crc32_of(p)] for p in _mine(files)}
    merged: dict[str, list[int]] = {}
    for part in all_gather_object(mine):
        merged.update(part)
    if rank0:
        (root / CHECKSUMS).write_text(json.dumps(merged, sort_keys=True, indent=0) + "\n")


def verify_checksums(root: Path) -> str | None:
    """Collective: None when every file listed in root/checksums.json is there with its size and checksum (or the
    checkpoint predates checksums); else what is wrong, naming the file."""
    listed = root / CHECKSUMS
    if not listed.is_file():
        return None if (root / "metadata.json").is_file() else f"{root} has no {CHECKSUMS} and no metadata.json"
    try:
        expected: dict[str, list[int]] = json.loads(listed.read_text())
    except (OSError, ValueError) as e:
        return f"{listed} is unreadable ({e})"
    problem = None
    for name in _mine(sorted(expected)):  # type: ignore[arg-type]
        path = root / name
        size, crc = expected[name]
        if not path.is_file():
            problem = f"{path} is missing"
        elif path.stat().st_size != size:
            problem = f"{path} is truncated or grown: {path.stat().st_size} bytes, {size} written"
        elif crc32_of(path) != crc:
            problem = f"{path} does not match its checksum (corrupted after it was written)"
        if problem:
            break
    problems = [p for p in all_gather_object(problem) if p]
    return str(problems[0]) if problems else None


FULL_MARGIN = 16 << 20
"""Free bytes under which a failed save counts as a full disk (torch's zip writer reports one as `unexpected pos`)."""


def disk_nearly_full(where: Path) -> bool:
    for p in (where, *where.parents):
        if p.exists():
            return shutil.disk_usage(p).free < FULL_MARGIN
    return False


def describe_save_error(e: BaseException, where: Path) -> str:
    """What went wrong writing the checkpoint `where`: a full disk named as such (ENOSPC in the exception's chain,
    or the disk nearly full after a failure that names neither), else the error itself."""
    if is_disk_full(e) or (not isinstance(e, OSError) and disk_nearly_full(where)):
        return no_space(where.parent, "learner.save_dir", f"the checkpoint {where.name}") + (
            f" (the partial checkpoint was removed; the error: {type(e).__name__}: {e})")  # fmt: skip
    return f"writing the checkpoint to {where} failed: {type(e).__name__}: {e}"
