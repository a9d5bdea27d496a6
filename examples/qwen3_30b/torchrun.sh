#!/usr/bin/env bash
# The learner alone on one 8-GPU node, for debugging startup, loading, the parallel layout and a step: the example's
# config with the first 4 of its 48 layers, TP=2 x EP=8 on 8 ranks (model.hf_overrides), launch.mode local, no engines. It trains once trajectories arrive: start a
# rollout worker against running engines (python -m megatron_sao rollout examples/qwen3_30b/config.yaml --engines URL)
# and pass the same --engines URL here, or watch it load and wait.
#   examples/qwen3_30b/torchrun.sh [--dry-run] [--section.key VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
dry=0
args=()
for a in "$@"; do if [ "$a" = "--dry-run" ]; then dry=1; else args+=("$a"); fi; done
cmd=(python -m torch.distributed.run --standalone --nproc-per-node=8 -m megatron_sao learn examples/qwen3_30b/config.yaml
  --launch.mode local --launch.nnodes 1 --launch.nproc_per_node 8 --launch.rollout_nodes 0 --parallel.tensor 2 --parallel.expert 8
  --model.hf_overrides '{"num_hidden_layers": 4}' --launch.run_dir runs/qwen3_30b_debug "${args[@]}")
if [ "$dry" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  exec python -m megatron_sao config check "${cmd[8]}" --model-elsewhere "${cmd[@]:9}"  # the 8-GPU node holds the model
fi
exec "${cmd[@]}"
