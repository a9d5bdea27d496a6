#!/usr/bin/env python
"""Supervised warm start on generated demonstrations: the agentic main job's first stage (run once, then cached).

    python tools/warm_start.py --config examples/tiny_agentic/config.yaml --base runs/tiny_agentic/base \\
        --out runs/tiny_agentic/warm [--demos 3000 --steps 600 --lr 3e-3 --mistake-rate 0.15 --seed 0] \\
        [--rollout.env.options '{"styles": [...]}' ...]   # config overrides, as for `python -m megatron_sao run`

The environment of the config (rollout.env) demonstrates its task: its `demonstrate` method gives the next turn for
the text so far, wrong with probability --mistake-rate per turn, so imitation leaves room for RL. Episodes are played
through the same agent loop and chat template the rollout workers use, so the tokens trained on are exactly the ones
the engines will see; the loss is cross-entropy on the demonstrator's (action) tokens only. The result is an HF model
directory at --out (weights, config, tokenizer) plus warm_start.json recording what made it; a second call with the
same inputs finds it there and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

STAMP = "warm_start.json"


def _inputs(args: argparse.Namespace, cfg: Any, demos: list[Any]) -> dict[str, Any]:
    """What the warm-started model depends on: the base weights, the settings, and the demonstrations themselves
    (their tokens: a change of the environment, its prompts or the chat template changes them)."""
    base = Path(args.base)
    digest = hashlib.sha256((base / "config.json").read_bytes())
    for f in sorted(base.glob("*.safetensors")):
        digest.update(f.read_bytes())
    shown = hashlib.sha256()
    for t in demos:
        shown.update(t.tokens.tobytes())
        shown.update(t.action_mask.tobytes())
    return {"base_sha256": digest.hexdigest(), "demos_sha256": shown.hexdigest(), "env": cfg.rollout.env.name,
            "env_options": cfg.rollout.env.options,
            "demos": args.demos, "steps": args.steps, "lr": args.lr, "batch": args.batch,
            "mistake_rate": args.mistake_rate, "seed": args.seed, "max_turns": cfg.rollout.max_turns,
            "max_total_tokens": cfg.rollout.max_total_tokens}  # fmt: skip


def demonstrations(cfg: Any, tokenizer: Any, n: int, mistake_rate: float, seed: int) -> list[Any]:
    """n episodes of the config's environment played by its demonstrator, as trajectories (tokens + action mask)."""
    from megatron_sao.engines.protocol import GenerateResult
    from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, ChatTemplateCodec
    from megatron_sao.rollout.envs import make_env

    env = make_env(cfg.rollout.env.name, cfg.rollout.env.options)
    rng = random.Random(seed)

    def demonstrator(input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
        text = env.demonstrate(tokenizer.decode(input_ids, skip_special_tokens=False), rng, mistake_rate)
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        return GenerateResult("demo", ids, [0.0] * len(ids), [0] * len(ids), "stop", {"type": "stop"}, 0,
                              len(input_ids)), "demonstrator"  # fmt: skip

    limits = AgentLoopConfig(max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens)
    loop = AgentLoop(env, ChatTemplateCodec(tokenizer), demonstrator, limits)
    return [loop.run(p) for p in env.make_prompts(n, seed=seed + 1)]


def train(model: Any, demos: list[Any], steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """Cross-entropy on the action tokens of random batches of demonstrations; the losses, one per step."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    model.train()
    columns = [TextColumn("[warm start] {task.completed}/{task.total} steps"), BarColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn()]  # fmt: skip
    with Progress(*columns, transient=not sys.stderr.isatty(), disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("sft", total=steps, loss="-")
        for step in range(steps):
            rows = rng.sample(demos, min(batch, len(demos)))
            width = max(t.header.num_tokens for t in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            attn = torch.zeros(len(rows), width, dtype=torch.long)
            for i, t in enumerate(rows):
                n = t.header.num_tokens
                ids[i, :n] = torch.from_numpy(t.tokens.astype("int64"))
                mask[i, :n] = torch.from_numpy(t.action_mask)
                attn[i, :n] = 1
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            target, on = ids[:, 1:], mask[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[on].float(), target[on])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss))
            progress.update(task, advance=1, loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            if not sys.stderr.isatty() and (step + 1) % max(steps // 10, 1) == 0:
                print(f"[warm start] step {step + 1}/{steps} loss {sum(losses[-20:]) / len(losses[-20:]):.3f}",
                      flush=True)  # fmt: skip
    model.eval()
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run's config (its rollout.env and turn limits)")
    p.add_argument("--base", required=True, help="the HF model to start from (with tokenizer)")
    p.add_argument("--out", required=True, help="where the warm-started HF model goes")
    p.add_argument("--demos", type=int, default=3000, help="demonstrated episodes")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="episodes per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mistake-rate", type=float, default=0.15, help="per-turn probability of a demonstrator error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args, overrides = p.parse_known_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sao.config import load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, overrides)  # `--rollout.env.options '{...}'` etc. on top of the config
    if not (Path(args.base) / "config.json").is_file():
        raise SystemExit(f"error: --base {args.base} is not an HF model directory (no config.json)")
    out = Path(args.out)
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    demos = demonstrations(cfg, tokenizer, args.demos, args.mistake_rate, args.seed)
    inputs = _inputs(args, cfg, demos)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("inputs") == inputs:
        print(f"[warm start] {out} is up to date (same base model, demonstrations and settings); nothing to do")
        return 0
    demo_reward = sum(t.header.reward for t in demos) / len(demos)
    print(f"[warm start] {len(demos)} demonstrated {cfg.rollout.env.name} episodes (mistake rate "
          f"{args.mistake_rate}: their reward {demo_reward:.3f}); training {args.steps} steps")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    losses = train(model, demos, args.steps, args.lr, args.batch, args.seed)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"inputs": inputs, "demo_reward": demo_reward, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
              "seconds": time.monotonic() - t0}  # fmt: skip
    (tmp / STAMP).write_text(json.dumps(record, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)  # whole or not at all: a cut run leaves no half-written model behind
    print(f"[warm start] {out}: loss {record['final_loss']:.3f} after {args.steps} steps, "
          f"{record['seconds']:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
