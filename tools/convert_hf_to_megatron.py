#!/usr/bin/env python
"""Convert a Hugging Face checkpoint directory into the project's megatron dist checkpoint (torch_dist), which
loads under any TP/EP/PP (models/checkpoint.py: canonical keys under `policy.`). Streams: peak memory is about
one decoder layer (docs/conversion.md).

python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--dtype bf16|fp32] [--force]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must be empty unless --force)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="megatron weight dtype (default: the HF checkpoint's; tensors HF keeps in fp32 stay fp32)",
    )
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron

    try:
        out = convert_hf_to_megatron(a.hf, a.out, dtype=a.dtype, force=a.force, progress=not a.quiet)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote megatron checkpoint {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
