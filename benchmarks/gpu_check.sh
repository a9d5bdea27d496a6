#!/usr/bin/env bash
# The prepared GPU check, one command for a session lent a GPU (the device tool's nvidia-h200):
#   1. benchmarks/gpu_qwen3_slice.py   a Qwen3-30B-A3B-shaped slice: tokens/s and MFU of forward+backward and SAO step
#   2. benchmarks/gpu_weight_sync.py   NCCL update group + abort, a device-side push to an embedded engine, pack rate
# Results: one JSON line per measurement, also written to $OUT/gpu_check.jsonl when $OUT is set.
#
# That machine has torch, transformers and safetensors but not megatron-core, pydantic, msgspec or pyzmq: carry them
# as wheels in .whl/ (ignored by git; name `.whl` in the run's carry), fetched here once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     megatron-core==0.16.1 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
#     msgspec==0.19.0 pyzmq==27.1.0
# and run:  bash benchmarks/gpu_check.sh   (about 5 minutes; timeout_s 540 leaves room for one rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp}/gpu_check.jsonl"
nvidia-smi -L || true
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
timeout 300 python3 benchmarks/gpu_qwen3_slice.py --layers 2 --trajectories 4 2>&1 | tee -a "$out"
timeout 200 python3 benchmarks/gpu_weight_sync.py 2>&1 | tee -a "$out"
