#!/usr/bin/env bash
# Install what the tests need (first use: creates .venv) and run them.
#   ./tests/run.sh            fast tier: everything not marked slow or gpu (what CI runs)
#   ./tests/run.sh --slow     also the slow tier
#   ./tests/run.sh --unit     only the in-process tests: the fast tier without `multiproc` (about a third of its time)
#   ./tests/run.sh --multiproc  only the `multiproc` tests (several processes: ranks, engines, workers; with --slow
#                             the slow ones too)
#   ./tests/run.sh --gpu      only the gpu tests (needs CUDA)
#   ./tests/run.sh -- ARGS    extra pytest arguments (e.g. -- -k gae -x)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh test

slow="not slow and "
procs=""
gpu=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --slow) slow=""; shift ;;
    --unit) procs="not multiproc and "; shift ;;
    --multiproc) procs="multiproc and "; shift ;;
    --gpu) gpu=1; shift ;;
    --) shift; pytest_args+=("$@"); break ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done

if [ "$gpu" -eq 1 ]; then marker="gpu"; else marker="${slow}${procs}not gpu"; fi

echo "[tests] ruff" >&2
"$SAO_PYTHON" -m ruff check .
set +e
"$SAO_PYTHON" -m pytest -m "$marker" "${pytest_args[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[tests] pytest collected no tests for '-m $marker'" >&2
  exit 1
fi
exit "$rc"
