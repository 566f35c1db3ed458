#!/usr/bin/env bash
# Make .venv-slime: Podium, SGLang and its router from PyPI with --no-deps, and what slime's
# (THUDM/slime) controller modules import, with no Ray, for measuring slime from a checkout
# under `podium run` (tools/framework_reach.py). slime is not on PyPI under its name, so it is
# not installed: the runner puts CHECKOUT on PYTHONPATH.
#
# slime parses its arguments with Megatron-LM's (`megatron.training.arguments`), which the
# megatron-core wheel does not ship: give a Megatron-LM checkout as MEGATRON (its folder goes on
# PYTHONPATH; nothing of it is built). SGLang's GPU kernels (sgl-kernel, flashinfer) are not
# installed: importing its argument and constants modules does not need them.
# Python 3.12: Megatron-LM's main branch uses `typing.override` (megatron/training/models/hybrid.py).
# PyPI has no CPU-only torch for 3.12, so torch here is PyPI's Linux wheel, the CUDA build, which
# runs on the CPU (~4 GB and a few minutes on a first install).
# Usage: tools/install-slime.sh CHECKOUT MEGATRON [VENV_DIR]   (default .venv-slime)
#   PYTHON312: the interpreter (default python3.12)
set -euo pipefail
checkout="$(cd "${1:?usage: tools/install-slime.sh CHECKOUT MEGATRON [VENV_DIR]}" && pwd)"
megatron="$(cd "${2:?usage: tools/install-slime.sh CHECKOUT MEGATRON [VENV_DIR]}" && pwd)"
cd "$(dirname "$0")/.."
venv="${3:-.venv-slime}"
"${PYTHON312:-python3.12}" -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0 -e ".[test]"
pip install -q --no-deps sglang sglang-router
pip install -q pyyaml transformers numpy requests httpx aiohttp pybase64 psutil triton pillow starlette msgspec \
  pyzmq IPython wandb setproctitle uvicorn fastapi pylatexenc
python - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: slime must run on Podium's stand-in")
PY
PYTHONPATH="$megatron" python tools/framework_reach.py "$checkout" --framework slime
