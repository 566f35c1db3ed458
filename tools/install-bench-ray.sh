#!/usr/bin/env bash
# Make .venv-bench: the Ray side of `python -m bench` (Ray, verl's single controller, the CPU
# build of torch) with Podium installed beside it, so one interpreter runs both children.
#
# verl's full dependency list is heavy (and can pull a CUDA build of torch); its single
# controller imports with this much. Usage: tools/install-bench-ray.sh [VENV_DIR]
# (default .venv-bench; ~2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-bench}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0                              # first: the CPU build
pip install -q "ray==2.60.0" tensordict omegaconf transformers -c <(echo torch==2.13.0)
pip install -q --no-deps verl==0.9.1
pip install -q -e ".[test]" -c <(echo torch==2.13.0)
python - <<'PY'
import ray, verl.single_controller.ray  # noqa: F401 - the classes bench/ray_side.py drives
print(f"ray {ray.__version__} and verl ready in {__import__('sys').prefix}")
PY
