#!/usr/bin/env bash
# Start megatron-sao. With no arguments: bootstrap .venv on first use and run the tiny CPU example.
#
# Until the end-to-end example lands (rollout -> bus -> learner -> weight sync), this runs the smoke job:
# a tiny megatron-core MoE model trained for a few steps on this machine through the CPU platform layer,
# and says so.
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh

if [ $# -eq 0 ]; then
  echo "[launch] the end-to-end tiny CPU example is not wired up yet; running the megatron-core smoke job instead" >&2
  exec "$SAO_PYTHON" -m megatron_sao smoke
fi
exec "$SAO_PYTHON" -m megatron_sao "$@"
