#!/usr/bin/env python
"""Convert the policy weights of a megatron dist checkpoint (written by convert_hf_to_megatron.py or the learner)
into a Hugging Face directory: safetensors shards + model.safetensors.index.json, config.json, and the
tokenizer files and generation_config.json of --hf-config. Streams: about one shard plus one layer in memory.

python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR --hf-config DIR [--dtype bf16|fp32] [--force]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt",
        required=True,
        help="megatron dist checkpoint directory, or a learner save_dir (converts the one `latest` names)",
    )
    p.add_argument("--out", required=True, help="output HF directory (must be empty unless --force)")
    p.add_argument("--hf-config", required=True, help="HF directory with the model's config.json (+ tokenizer)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="HF tensor dtype (default: each tensor's dtype in the original HF checkpoint)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="say what it would convert, what is missing; write nothing")
    a = p.parse_args(argv)
    from megatron_sao.learner.checkpoint import LATEST

    ckpt = Path(a.ckpt)  # a checkpoint, or the learner's save_dir: the one its `latest` names
    if (ckpt / LATEST).is_file():
        ckpt = ckpt / (ckpt / LATEST).read_text().strip()
    if a.dry_run:
        checks = {"--ckpt": ckpt / "metadata.json", "--hf-config": Path(a.hf_config) / "config.json"}
        missing = [f"{flag} {path.parent} (no {path.name})" for flag, path in checks.items() if not path.is_file()]
        print(f"would convert the policy of {ckpt} into {a.out} (config and tokenizer from {a.hf_config}, dtype "
              f"{a.dtype or 'as in the original HF checkpoint'}, shards up to {a.max_shard_size})")  # fmt: skip
        print("missing now: " + "; ".join(missing) if missing else "every input is there")
        return 0
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_sao.learner.integrity import verify_checksums

    problem = verify_checksums(ckpt) if (ckpt / "metadata.json").is_file() else None
    if problem:
        print(f"error: checkpoint {ckpt} is damaged: {problem}; convert another one", file=sys.stderr)
        return 2
    try:
        out = convert_megatron_to_hf(
            ckpt,
            a.out,
            a.hf_config,
            dtype=a.dtype,
            max_shard_size=a.max_shard_size,
            force=a.force,
            progress=not a.quiet,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote HF model {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
