#!/usr/bin/env bash
# Run NeMo-RL's GRPO entry point (examples/run_grpo.py of a checkout, unmodified) under
# `podium run` on CPU with a tiny offline model and dataset, and print the first line it stops at
# (tools/nemo_rl_grpo.py says what runs and what it prints). A measurement, not a test: CI cannot
# fetch the checkout. Needs .venv-nemo (tools/install-nemo-rl.sh CHECKOUT).
#
# NeMo-RL starts each worker class with its own interpreter (`py_executable`), in a venv named
# after the class under NEMO_RL_VENV_DIR, which its builder (nemo_rl/utils/venvs.py) reuses when
# it is there: tools/install-nemo-rl.sh made them (its header says how). NeMo-RL's builder then
# runs as usual (a STRICT_SPREAD placement group and a task per node) and finds them.
# Usage: tools/run-nemo-rl.sh CHECKOUT [--gpus N] [HYDRA_OVERRIDE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(realpath "${1:?usage: tools/run-nemo-rl.sh CHECKOUT [--gpus N] [OVERRIDE ...]}")"
shift
venv="$(realpath "${NEMO_VENV:-.venv-nemo}")"
[ -x "$venv/bin/python" ] || { echo "no $venv: run tools/install-nemo-rl.sh $checkout" >&2; exit 2; }
export NEMO_RL_VENV_DIR="$venv/nemo-rl-venvs"
[ -f "$NEMO_RL_VENV_DIR/CLASSES" ] || { echo "no per-class venvs: run tools/install-nemo-rl.sh $checkout" >&2; exit 2; }
export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
unset PODIUM_ADDRESS
gpus=2
if [ "${1:-}" = "--gpus" ]; then gpus="$2"; shift 2; fi
exec "$venv/bin/python" -m podium.cli run --num-cpus 16 --num-gpus "$gpus" -- \
  "$venv/bin/python" tools/nemo_rl_grpo.py "$checkout" --gpus "$gpus" "$@"
