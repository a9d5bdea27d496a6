#!/usr/bin/env bash
# Start megatron-sao.
#   ./launch.sh                          the tiny CPU example end to end: an embedded engine, a rollout worker, the
#                                        bus and a one-rank learner training a random 2-layer MoE for 20 versions
#                                        (examples/tiny_cpu/config.yaml; makes the model under runs/tiny_cpu/ once;
#                                        running it again resumes from runs/tiny_cpu/checkpoints)
#   ./launch.sh run CONFIG [--k v ...]   any config, everything on this machine (launch.mode=local)
#   ./launch.sh <command> ...            any `python -m megatron_sao` command (learn, rollout, engine, smoke, ...)
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh

if [ $# -eq 0 ]; then
  model=runs/tiny_cpu/model
  if [ ! -f "$model/config.json" ]; then
    echo "[launch] making the tiny random model in $model" >&2
    "$SAO_PYTHON" tools/make_tiny_model.py --family qwen3_moe --out "$model" --force
  fi
  exec "$SAO_PYTHON" -m megatron_sao run examples/tiny_cpu/config.yaml
fi
exec "$SAO_PYTHON" -m megatron_sao "$@"
