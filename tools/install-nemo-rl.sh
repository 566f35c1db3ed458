#!/usr/bin/env bash
# Make .venv-nemo: Podium, and what NeMo-RL's GRPO entry point (examples/run_grpo.py) imports,
# for tools/run-nemo-rl.sh, from a checkout of NVIDIA-NeMo/RL (not on PyPI: `nemo-rl` there is
# an empty placeholder). No Ray: `import ray` is Podium's stand-in.
#
# NeMo-RL's own environment is its uv.lock (Python 3.13, CUDA torch 2.11, vLLM/flash-attn wheels
# from GitHub), which cannot be built here. Instead: the checkout is installed --no-deps, then the
# packages its driver, environment and worker modules import, with a transformers that meets its
# pins (pyproject: >=5.5,<5.9; nemo_rl/models/policy/__init__.py asserts <5.12), and Podium's
# torch (2.13; NeMo-RL pins 2.11).
#
# NeMo-RL runs each worker class in its own virtualenv (`py_executable`, built by
# nemo_rl/utils/venvs.py with `uv sync` against its lock, which needs the network and Python
# 3.13.14). As its container does (nemo_rl/utils/prefetch_venvs.py), the per-class venvs are made
# ahead, in VENV_DIR/nemo-rl-venvs (tools/run-nemo-rl.sh sets NEMO_RL_VENV_DIR to it), one per
# class whose registry entry (nemo_rl/distributed/ray_actor_environment_registry.py) is a
# `uv run ...` command: a venv of its own (own prefix and interpreter) whose site path adds
# .venv-nemo's packages. NeMo-RL's builder finds them and returns their interpreter, and Podium
# starts each worker with it. The vLLM tier's venvs (the classes registered with
# PY_EXECUTABLES.VLLM) also see vLLM 0.25.1, NeMo-RL's pin, installed --no-deps with the pure-Python
# packages `import vllm` needs into one folder they share (its CUDA kernels are not loaded on a
# machine without a GPU). `uv` itself is installed too (NeMo-RL's builder calls it when a venv is
# missing).
# Usage: tools/install-nemo-rl.sh CHECKOUT [VENV_DIR]   (default .venv-nemo)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(realpath "${1:?usage: tools/install-nemo-rl.sh CHECKOUT [VENV_DIR]}")"
venv="${2:-.venv-nemo}"
[ -f "$checkout/nemo_rl/__init__.py" ] || { echo "$checkout is not a NeMo-RL checkout (no nemo_rl/)" >&2; exit 2; }
# NeMo-RL needs Python 3.13 (pydantic models over typing.TypedDict, nemo_rl/algorithms/grpo.py);
# PYTHON313 names one, else the first python3.13 that runs (pyenv's shim answers `command -v`
# even where 3.13 is not selected). PyPI's torch for 3.13 is its CUDA build (a few GB).
py313="${PYTHON313:-}"
if [ -z "$py313" ]; then
  for candidate in python3.13 "${HOME:-/root}"/.pyenv/versions/3.13*/bin/python3.13 /usr/bin/python3.13; do
    if "$candidate" -V >/dev/null 2>&1; then py313="$candidate"; break; fi
  done
fi
[ -n "$py313" ] || { echo "no python3.13 (NeMo-RL needs it): set PYTHON313" >&2; exit 2; }
"$py313" -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0 -e ".[test]"
# The checkout is not installed (its pyproject wants Python >=3.13.14 and its CUDA pins):
# tools/run-nemo-rl.sh puts it on
# PYTHONPATH, which NeMo-RL passes on to every worker.
pip install -q uv "transformers>=5.5.0,<5.9.0" "datasets>=4.0.0" accelerate rich pydantic pillow requests \
  math-verify hydra-core omegaconf torchdata tensordict pyyaml tqdm scipy pandas psutil zstandard pyzmq \
  prometheus_client matplotlib plotly tensorboard wandb mlflow swanlab nvidia-ml-py nvtx colored tiktoken \
  sentencepiece blobfile num2words soundfile fastapi uvicorn absl-py
# swanlab (imported by nemo_rl/utils/logger.py) pins protobuf<7, which pip then installs; Podium's
# generated code needs >=7.35.1, and swanlab imports with it.
pip install -q "protobuf>=7.35.1,<8"
# The per-class venvs, and the vLLM tier's shared folder.
tiers="$venv/nemo-rl-venvs"
vllm_dir="$venv/nemo-rl-vllm"
mkdir -p "$tiers"
pip install -q --no-deps --target "$vllm_dir" vllm==0.25.1
pip install -q --no-deps --target "$vllm_dir" msgspec cachetools blake3 py-cpuinfo cbor2 ijson setproctitle \
  partial-json-parser diskcache pybase64 einops python-json-logger "openai>=2,<3" jiter distro watchfiles gguf \
  openai-harmony llguidance "xgrammar<1" apache-tvm-ffi
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base="$(python -c 'import sys; print(sys._base_executable)')"
python - "$checkout/nemo_rl/distributed/ray_actor_environment_registry.py" > "$tiers/CLASSES" <<'PY'
import re, sys
# "module.Class": PY_EXECUTABLES.X or one of the *_EXECUTABLE names; SYSTEM runs in .venv-nemo.
for fqn, value in re.findall(r'"([\w.]+)":\s*([\w.]+),', open(sys.argv[1]).read()):
    if value != "PY_EXECUTABLES.SYSTEM":
        print(fqn, "vllm" if value in ("PY_EXECUTABLES.VLLM", "VLLM_EXECUTABLE") else "other")
PY
while read -r fqn tier; do
  dir="$tiers/$fqn"
  rm -rf "$dir"
  "$base" -m venv --without-pip "$dir"
  purelib="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  {
    if [ "$tier" = vllm ]; then echo "$(realpath "$vllm_dir")"; fi
    echo "import site; site.addsitedir('$site')"
  } > "$purelib/_nemo_rl_base.pth"
done < "$tiers/CLASSES"
python - "$checkout" <<'PY'
import importlib.util, sys
if importlib.util.find_spec("ray") is not None:
    sys.exit("a `ray` package is importable in this environment: NeMo-RL must use Podium's stand-in")
import transformers
print("nemo_rl from", sys.argv[1], "with transformers", transformers.__version__, "in", sys.prefix)
PY
