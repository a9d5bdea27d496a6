#!/usr/bin/env python
"""Write N prompts of an environment to a JSONL file (one {"id", ...} object per line) for rollout.env.prompts.

python tools/make_prompts.py --env arithmetic --n 1000 --out data/arith.jsonl [--seed 0] [--option key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_sao.rollout.envs import make_env
from megatron_sao.rollout.prompts import write_jsonl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", required=True, help="registered name (arithmetic, style_preference, ...) or module:Class")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], help="environment option key=value (value as JSON)")
    a = p.parse_args(argv)
    try:
        options = {}
        for kv in a.option:
            key, sep, value = kv.partition("=")
            if not sep:
                raise ValueError(f"--option {kv!r}: expected key=value")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        if a.n < 1:
            raise ValueError("--n must be >= 1")
        records = make_env(a.env, options).make_prompts(a.n, seed=a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out, records)
    print(f"wrote {len(records)} {a.env} prompts to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
