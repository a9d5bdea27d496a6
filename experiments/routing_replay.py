#!/usr/bin/env python
"""MoE routing replay where engine and learner route differently: the engine serves the model in bfloat16 (the
checkpoint's dtype), the learner trains it in float32 (as a bf16 SGLang engine beside an fp32-master learner), so a
share of the top-k decisions differ between the forward that sampled a token and the one that trains on it. Two
arms, the same in everything else (the style example: a random tiny qwen3_moe, 4 experts top-2, one-turn writing
rewarded for the "cute" style's markers; sao, 8 trajectories per step):

  free           the engines return their routes (rollout.return_routed_experts), the learner routes by its own
                 router and only counts how often it disagrees
  replay         the policy routes every token as the engine did (learner.routing_replay); the critic by its own
  replay_critic  the policy and the critic both route by the engine's routes (learner.critic_routing_replay)

Reported per arm (mean ± std over seeds, over every policy step): routing/mismatch_frac (the learner's own router
against the engine's: the same quantity in both arms; on steps whose trajectories all came from the learner's own
version it is the numeric difference alone, elsewhere policy drift adds to it), dis/masked_frac, dis/mismatch_kl
(k3 estimate of KL(engine || learner) on the action tokens, from the policy update's forward) and the mean reward
of the last quarter of the steps, and the critic's honest explained variance (value/explained_variance: its values
before the step's first critic update) over the policy steps, the figure that decides whether the critic replays.

    python experiments/routing_replay.py            # 3 arms x 3 seeds x 30 steps, ~8 min on 2 CPUs
    python experiments/routing_replay.py --quick    # 3 arms x 3 seeds x 6 steps, ~3 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (
    RUNS,
    STYLE,
    Run,
    RunSpec,
    add_common_args,
    apply_quick,
    mean_spread,
    publish,
    pyplot,
    run_arm,
    save_figure,
)

ARMS = {
    "free": ("--rollout.return_routed_experts", "true"),
    "replay": ("--learner.routing_replay", "true"),
    "replay_critic": ("--learner.routing_replay", "true", "--learner.critic_routing_replay", "true"),
}
COLORS = {"free": "C1", "replay": "C0", "replay_critic": "C2"}
KEYS = ("routing/mismatch_frac", "dis/masked_frac", "dis/mismatch_kl", "value/explained_variance", "reward/mean")
MEANS = KEYS[:4]  # averaged over the policy steps; the reward is read over the last quarter
QUICK = {"steps": 6}


def base_model(work: Path) -> Path:
    """The style example's model (what ./launch.sh makes: a random 2-layer qwen3_moe, 4 experts, top-2), stored in
    bfloat16: the engine serves it as stored, the learner trains an fp32 copy, and pushes are cast to the
    checkpoint's dtype."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from megatron_sao.models.tiny import make_tiny_model

    model = work / "model_bf16"
    if not (model / "config.json").is_file():
        make_tiny_model("qwen3_moe", model, force=True)
        for f in model.glob("*.safetensors"):
            tensors = load_file(str(f))
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, str(f))
        cfg = json.loads((model / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
        (model / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


def spec(arm: str, seed: int, args: argparse.Namespace) -> RunSpec:
    common = ("--learner.max_steps", str(args.steps), "--learner.save_interval", "100000",
              "--algo.value.pretrain_samples", "8")  # fmt: skip
    return RunSpec(label=arm, config=STYLE, model=args.model, overrides=(*common, *ARMS[arm]), seed=seed,
                   engine_args=("--enable-return-routed-experts",))  # fmt: skip


def per_run(run: Run) -> dict[str, Any]:
    steps = [s for s in run.steps if "routing/mismatch_frac" in s]
    tail = steps[-max(1, len(steps) // 4) :]
    out: dict[str, Any] = {"seed": run.spec.seed, "policy_steps": len(steps), "wall_s": run.wall_s}
    for key in MEANS:
        vals = [s[key] for s in steps if s.get(key) is not None]
        out[key] = float(np.mean(vals)) if vals else None
    out["final_reward"] = float(np.mean([s["reward/mean"] for s in tail])) if tail else None
    fresh = [s["routing/mismatch_frac"] for s in steps if s.get("staleness/max", 1) == 0]
    out["mismatch_same_weights"] = float(np.mean(fresh)) if fresh else None  # engine and learner on one version
    out["series"] = {key: [s.get(key) for s in steps] for key in KEYS}
    return out


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    head = ("| arm | seeds | routing/mismatch_frac, steps at staleness 0 | routing/mismatch_frac, all steps | "
            "dis/masked_frac | dis/mismatch_kl | value/explained_variance | reward, last quarter |")  # fmt: skip
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, runs in rows.items():
        cells = [mean_spread([r[k] for r in runs]) for k in ("mismatch_same_weights", *MEANS, "final_reward")]
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(rows: dict[str, list[dict[str, Any]]], png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(KEYS), figsize=(4 * len(KEYS), 3.2))
    for ax, key in zip(axes, KEYS):
        for arm, runs in rows.items():
            for i, r in enumerate(runs):
                y = [v for v in r["series"][key] if v is not None]
                ax.plot(np.arange(1, len(y) + 1), y, color=COLORS[arm], alpha=0.7, label=arm if i == 0 else None)
        ax.set_title(key)
        ax.set_xlabel("policy step")
        if key == "dis/mismatch_kl":
            ax.set_yscale("log")
    axes[0].legend()
    save_figure(fig, png, "bf16 engine, fp32 learner: routing replay off (free), policy only, policy and critic")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="policy steps per run")
    add_common_args(p, RUNS / "routing_replay", QUICK)
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    args.runs.mkdir(parents=True, exist_ok=True)
    args.model = base_model(args.runs)
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        for arm in ARMS:
            run = run_arm(spec(arm, seed, args), args.runs / f"{arm}_s{seed}{suffix}")
            rows[arm].append(per_run(run))
    png = args.figures / f"routing_replay{suffix}.png"
    figure(rows, png)
    note = ("Both arms' engines serve in bfloat16 and return their routes; the learner trains in float32. "
            "routing/mismatch_frac is measured the same way in both (the learner's own top-k set against the "
            "engine's, per token and layer); the replay arms' policies route by the engine's, replay_critic's "
            "critic too.")  # fmt: skip
    publish(f"routing_replay{suffix}", args.results, png, table(rows), note, {"arms": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
