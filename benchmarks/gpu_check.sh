#!/usr/bin/env bash
# The prepared GPU check, one command for a session lent a GPU (the device tool's nvidia-h200), within 10 minutes:
#   1. benchmarks/gpu_qwen3_slice.py   a Qwen3-30B-A3B-shaped slice: tokens/s and MFU of forward+backward and SAO step
#   2. tests/gpu (pytest -m gpu)       what must hold on a GPU: policy on CUDA = transformers, TE specs = local spec,
#                                      NCCL update group + abort, NCCL push between two processes, device push into
#                                      an embedded engine, the push agent's CUDA IPC handover opened by another
#                                      process (each skips, naming why, where its hardware is missing)
#   3. benchmarks/gpu_weight_sync.py   the device-side packing rate of a 1 GiB expert bucket
#   4. examples/smollm2_tools          3 SAO steps with the learner on the GPU (the embedded engine on the CPUs):
#                                      step, critic, policy and push seconds, generated tokens/s. The weights are
#                                      random of SmolLM2's shapes (540 MB do not fit the carry): timings, not
#                                      learning. Carry runs/models/smollm2-shape, made here by
#                                      python tools/smollm2.py --shape-only runs/models/smollm2-shape
#   (tests/gpu also runs SGLang's gpu_tensor_hash kernel on CUDA against the port: put the sglang 0.5.23 wheel in
#   .whl/sglang/ -- cp ~/.cache/megatron-sao/wheels/sglang-0.5.23-*.whl .whl/sglang/ -- never installed, only read)
# Results: one JSON line per measurement in $OUT/gpu_check.jsonl, the GPU tier's log in $OUT/gpu_tests.log.
#
# That machine has torch, transformers, safetensors and pytest but not megatron-core, pydantic, msgspec or pyzmq:
# carry them as wheels in .whl/ (ignored by git; name `.whl` in the run's carry), fetched here once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     megatron-core==0.16.1 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
#     msgspec==0.19.0 pyzmq==27.1.0
# and run:  bash benchmarks/gpu_check.sh   (timeout_s 540 leaves room for one rerun)
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
for w in .whl/sglang/sglang-*.whl; do [ -f "$w" ] && export SAO_SGLANG_WHEEL="$PWD/$w"; done
out_dir="${OUT:-/tmp}"
out="$out_dir/gpu_check.jsonl"
nvidia-smi -L || true
python3 -c "import torch, transformers, megatron.core as m; print(torch.__version__, transformers.__version__, m.__version__)"
rc=0
timeout 240 python3 benchmarks/gpu_qwen3_slice.py --layers 2 --trajectories 4 2>&1 | grep -v Warning | tee -a "$out" \
  || rc=1
timeout 240 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -rA -s -q 2>&1 | tee "$out_dir/gpu_tests.log" \
  || rc=1
timeout 60 python3 benchmarks/gpu_weight_sync.py 2>&1 | tee -a "$out" || rc=1
shape=runs/models/smollm2-shape
if [ -f "$shape/config.json" ]; then
  run_dir=/tmp/smollm2_gpu
  timeout 200 bash -c "python3 tools/smollm2.py --random-weights $shape >/dev/null && python3 -m megatron_sao run \
      examples/smollm2_tools/config.yaml --model.hf_path $shape --learner.max_steps 3 \
      --algo.value.pretrain_samples 8 --launch.run_dir $run_dir" > "$out_dir/smollm2_run.log" 2>&1 || rc=1
  python3 - "$run_dir" <<'PY' | tee -a "$out" || rc=1
import json, statistics, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if l.strip()]
steps = [r for r in rows if "time/step" in r]
med = lambda k: statistics.median(r[k] for r in steps if k in r) if any(k in r for r in steps) else None
print(json.dumps({"smollm2_random_weights_steps": len(steps), **{k: med(k) for k in (
    "time/step", "time/critic", "time/policy", "time/sync", "throughput/tokens_per_s")}}))
PY
else
  echo "[gpu_check] no $shape: the SmolLM2 steps were not run (python tools/smollm2.py --shape-only $shape)" | tee -a "$out"
fi
exit "$rc"
