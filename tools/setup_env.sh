#!/usr/bin/env bash
# Shared by ./launch.sh and ./tests/run.sh: create .venv on first use and install the project into it.
# On a machine without CUDA it pins torch==2.13.0 (the CPU build these machines keep on disk; any other spec
# downloads several GB of CUDA wheels). Re-running is cheap: a stamp of pyproject.toml skips the install.
# Usage: source tools/setup_env.sh [extra]   (extra: test, plot, ...; default none)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_extra="${1:-}"
_venv="${SAO_VENV:-$_root/.venv}"
_py="${PYTHON:-python3}"

if [ ! -x "$_venv/bin/python" ]; then
  echo "[setup] creating $_venv" >&2
  "$_py" -m venv "$_venv"
  "$_venv/bin/python" -m pip install -q --upgrade pip
fi
_stamp="$_venv/.sao-installed-${_extra:-base}"
_want="$(cat "$_root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
  if ! "$_venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "[setup] CUDA machine: installing torch from PyPI" >&2
      "$_venv/bin/python" -m pip install -q torch
    else
      echo "[setup] no CUDA: installing torch==2.13.0 (CPU build)" >&2
      "$_venv/bin/python" -m pip install -q torch==2.13.0
    fi
  fi
  echo "[setup] installing megatron-sao${_extra:+[$_extra]} (editable)" >&2
  "$_venv/bin/python" -m pip install -q -e "$_root${_extra:+[$_extra]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$_venv/bin/python" -c "import megatron_sao, megatron.core" >/dev/null 2>&1 \
    || { echo "[setup] install failed: megatron_sao or megatron.core does not import" >&2; exit 1; }
  echo "$_want" > "$_stamp"
fi
export PATH="$_venv/bin:$PATH"
export SAO_PYTHON="$_venv/bin/python"
