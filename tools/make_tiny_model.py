#!/usr/bin/env python
"""Build a small randomly initialized HF model of a supported family (with a tokenizer) for tests and examples.

python tools/make_tiny_model.py --family qwen3_moe --out /tmp/tiny-qwen3 [--layers 2 --hidden 64 ...]
"""

from __future__ import annotations

import argparse
import sys

from megatron_sao.models.tiny import FAMILIES, make_tiny_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--out", required=True, help="output directory (must be empty unless --force)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (multiple of 16)")
    p.add_argument("--experts", type=int, default=4, help="routed experts per MoE layer")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files (token-in/token-out)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    p.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="weight std (default: transformers' 0.02); also randomizes norms/biases so parity checks bite",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="tie_word_embeddings=true (no lm_head.weight)")
    p.add_argument("--max-shard-size", default=None, help="safetensors shard size, e.g. 50MB (default: one file)")
    a = p.parse_args(argv)
    try:
        out = make_tiny_model(
            a.family,
            a.out,
            layers=a.layers,
            hidden=a.hidden,
            experts=a.experts,
            topk=a.topk,
            vocab_size=a.vocab_size,
            seed=a.seed,
            dtype=a.dtype,
            tokenizer=not a.no_tokenizer,
            force=a.force,
            init_std=a.init_std,
            tie_embeddings=a.tie_embeddings,
            max_shard_size=a.max_shard_size,
        )
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.family} tiny model to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
