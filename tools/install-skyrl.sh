#!/usr/bin/env bash
# Make .venv-skyrl: Podium with SkyRL 0.4.0's wheel from PyPI and no Ray, on Python 3.12, ready
# for `podium run` and the `skyrl` tests (tests/integration/skyrl).
#
# SkyRL needs Python 3.12 (its wheel says so, and on 3.11 its pydantic models do not build:
# "use typing_extensions.TypedDict on Python < 3.12"). PyPI has no CPU-only torch for 3.12, so
# torch here is PyPI's Linux wheel, the CUDA build, which runs on the CPU: ~4 GB and a few
# minutes on a first install (pip's cache makes later ones quick).
# skyrl is installed with --no-deps: its requirements pull vLLM, flash-attn, wandb, Ray...
# Only what its dispatch, registries (utils.ppo_utils), worker-group (workers.worker) and
# training-batch modules import is added here.
# Usage: tools/install-skyrl.sh [VENV_DIR]   (default .venv-skyrl)
#   PYTHON312: the interpreter (default python3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-skyrl}"
"${PYTHON312:-python3.12}" -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch -e ".[test]"
pip install -q --no-deps skyrl==0.4.0 skyrl-gym==0.4.0
# transformers in the range SkyRL's repository pins (its wheel allows up to 5.16.1);
# skyrl-gym's own requirements are func_timeout, pandas, requests and omegaconf.
pip install -q "transformers>=5.6.1,<=5.8.0" "peft==0.18.1" omegaconf hydra-core loguru jaxtyping \
  cloudpathlib pydantic datasets tensordict "safetensors>=0.6.2" pillow rich func_timeout pandas requests
python - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: the skyrl tests must not use it")
PY
podium run -- python -c "import skyrl.backends.skyrl_train.distributed.dispatch, skyrl.backends.skyrl_train.utils.ppo_utils, skyrl.backends.skyrl_train.workers.worker; print('skyrl', __import__('importlib.metadata').metadata.version('skyrl'), 'ready on Podium in', __import__('sys').prefix)"
