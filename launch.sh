#!/usr/bin/env bash
# Start megatron-sao.
#   ./launch.sh                          the agentic main job on this machine (examples/tiny_agentic/config.yaml):
#                                        a random 2-layer MoE is warm-started on demonstrations of multi-turn tool
#                                        use (tools/warm_start.py, cached), then value pre-training and SAO with an
#                                        embedded engine, a rollout worker, the bus and a one-rank learner; prints the
#                                        reward before and after (everything under runs/tiny_agentic/; running it
#                                        again resumes from its checkpoints)
#   ./launch.sh style                    the second example: one-turn writing with a style reward
#                                        (examples/tiny_cpu/config.yaml)
#   ./launch.sh run CONFIG [--k v ...]   any config, everything on this machine (launch.mode=local)
#   ./launch.sh <command> ...            any `python -m megatron_sao` command (learn, rollout, engine, smoke, ...)
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # launch.sh's own modes first, then the commands it passes on
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo
  echo "python -m megatron_sao commands (./launch.sh <command> --help for each):"
  sed -n '/^"""/,/^"""/p' megatron_sao/cli.py | sed '1d;$d'
  exit 0
fi
source tools/setup_env.sh ""  # (not this script's arguments: they would name an extra)

tiny_model() {  # tiny_model DIR HIDDEN: a random qwen3_moe with a tokenizer, made once
  if [ ! -f "$1/config.json" ]; then
    echo "[launch] making the tiny random model in $1" >&2
    "$SAO_PYTHON" tools/make_tiny_model.py --family qwen3_moe --out "$1" --hidden "$2" --force
  fi
}

if [ $# -eq 0 ]; then
  tiny_model runs/tiny_agentic/base 128
  "$SAO_PYTHON" tools/warm_start.py --config examples/tiny_agentic/config.yaml --base runs/tiny_agentic/base \
    --out runs/tiny_agentic/warm
  exec "$SAO_PYTHON" -m megatron_sao run examples/tiny_agentic/config.yaml
fi
if [ "$1" = "style" ]; then  # the config makes its tiny model (model.make_tiny)
  shift
  exec "$SAO_PYTHON" -m megatron_sao run examples/tiny_cpu/config.yaml "$@"
fi
exec "$SAO_PYTHON" -m megatron_sao "$@"
