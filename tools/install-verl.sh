#!/usr/bin/env bash
# Make .venv-verl: Podium with the verl 0.9.1 wheel from PyPI and no Ray, ready for
# `podium run` and the `verl` tests (tests/integration/verl).
#
# verl is installed with --no-deps: its requirements pull Ray, vLLM-era transformers, wandb...
# Only what verl's single_controller, protocol and utils modules import is added here.
# Usage: tools/install-verl.sh [VENV_DIR]   (default .venv-verl; ~1 minute)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-verl}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0 -e ".[test]"
pip install -q --no-deps verl==0.9.1
# What verl.single_controller, verl.protocol and verl.utils import beyond Podium's own
# dependencies (torch, numpy, tensordict, cloudpickle): verl.utils imports its config
# (omegaconf) and tokenizer (transformers, in the range verl 0.9.1 declares) modules.
# The rest is what verl.trainer.main_ppo, its TaskRunner and verl's workers and
# checkpoint engines import (hydra, datasets, peft, torchdata, fastapi/uvicorn for the
# rollout servers' modules, codetiming, cachetools, pillow); no vLLM, no Ray.
pip install -q "omegaconf>=2.3" "hydra-core>=1.3" "transformers>=5.5.3,<5.11,!=5.6.0" \
  datasets peft torchdata fastapi uvicorn codetiming cachetools pillow
python - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: the verl tests must not use it")
PY
podium run -- python -c "import verl.single_controller.ray, verl.utils.ray_utils, verl.trainer.main_ppo, verl.checkpoint_engine; print('verl', __import__('verl').__version__, 'ready on Podium in', __import__('sys').prefix)"
