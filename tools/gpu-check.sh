#!/usr/bin/env bash
# The prepared GPU check: from a fresh clone on a bare machine with an NVIDIA GPU and driver,
# install what the GPU tests need, run the `gpu` marker and a short GPU benchmark, and print
# one summary. About 8 minutes, most of it downloading torch's CUDA build from PyPI; every
# step has a timeout. Needs python3 (with venv) and PyPI; nothing else from the internet.
#
#   tools/gpu-check.sh [--venv DIR]    (default DIR: .venv-gpu in the repository)
#
# A second run reuses DIR when torch with CUDA and podium already import there.
# Exit status: 0 when the GPU tests passed and the benchmark ran, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu
if [ "${1:-}" = "--venv" ] && [ -n "${2:-}" ]; then VENV=$2; fi
OUT=${GPU_CHECK_OUT:-gpu-check-out}
mkdir -p "$OUT"
started=$(date +%s)
status_install=skipped status_tests=skipped status_bench=skipped

step() { echo; echo "== $* ($(( $(date +%s) - started )) s)"; }

step "GPU"
if ! command -v nvidia-smi >/dev/null || ! timeout 30 nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia-smi.txt"; then
  echo "no NVIDIA GPU or driver here (nvidia-smi missing or failing): nothing to check"
  exit 1
fi

if [ -x "$VENV/bin/python" ] && timeout 120 "$VENV/bin/python" -c "import torch, podium, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
  step "reusing $VENV (torch with CUDA and podium already import there)"
  timeout 120 "$VENV/bin/pip" install -q --no-deps -e . > "$OUT/install.log" 2>&1 || true
  status_install=ok
else
step "install into $VENV (torch's CUDA build from PyPI: plain 'pip install torch')"
if timeout 420 bash -c "python3 -m venv '$VENV' && . '$VENV/bin/activate' && pip install -q --upgrade pip && pip install -q torch && pip install -q -e '.[test]'" > "$OUT/install.log" 2>&1; then
  status_install=ok
else
  status_install="failed (see $OUT/install.log)"
  tail -20 "$OUT/install.log"
fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate" 2>/dev/null || true
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available())" | tee "$OUT/torch.txt"

if [ "$status_install" = ok ]; then
  step "pytest -m gpu tests/gpu"
  if timeout 300 python -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider --junitxml "$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1; then
    status_tests=passed
  else
    status_tests="FAILED (see $OUT/gpu-tests.log)"
  fi
  tail -25 "$OUT/gpu-tests.log"

  step "bench/gpu_bench.py"
  if timeout 180 python bench/gpu_bench.py --json "$OUT/gpu-bench.json" > "$OUT/gpu-bench.log" 2>&1; then
    status_bench=ok
  else
    status_bench="failed (see $OUT/gpu-bench.log)"
  fi
  grep -v '^GPUBENCH ' "$OUT/gpu-bench.log" | tail -30

  # Weight broadcast over NCCL beside NCCL's own broadcast busbw (two GPUs; one GPU: says so).
  step "bench.broadcast_gpu"
  timeout 240 python -m bench.broadcast_gpu --json "$OUT/broadcast-gpu.json" > "$OUT/broadcast-gpu.log" 2>&1 \
    || echo "broadcast_gpu failed (see $OUT/broadcast-gpu.log)"
  tail -8 "$OUT/broadcast-gpu.log"

  # The asynchronous GRPO example on the GPU build of vLLM, synchronous and with staleness 2,
  # where vLLM is installed (pip install -e ".[vllm]": several GB, not part of this check).
  if timeout 120 python -c "import vllm" 2>/dev/null; then
    step "examples/grpo_async.py (vLLM on the GPU)"
    for k in 0 2; do
      timeout 300 python examples/grpo_async.py --steps 1000 --time-budget 30 --max-staleness "$k" \
        > "$OUT/grpo-async-$k.log" 2>&1 || echo "grpo_async --max-staleness $k failed (see $OUT/grpo-async-$k.log)"
      grep '^max-staleness' "$OUT/grpo-async-$k.log"
    done
  else
    echo "vLLM is not installed in $VENV: the async GRPO example is not run"
  fi
fi

step "summary"
{
  echo "gpu:      $(head -1 "$OUT/nvidia-smi.txt")"
  echo "torch:    $(cat "$OUT/torch.txt")"
  echo "install:  $status_install"
  echo "tests:    $status_tests $(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' "$OUT/gpu-tests.log" 2>/dev/null | tail -1)"
  echo "bench:    $status_bench"
  if [ -f "$OUT/gpu-bench.json" ]; then
    python - "$OUT/gpu-bench.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for m in doc["measures"]:
    unit = "calls/s" if "calls/s" in m else "GB/s"
    print(f"  {m['measure']:<34} {m['bytes'] / 2**20:>7.0f} MiB  {m[unit]:>9} {unit}")
EOF
  fi
  echo "seconds:  $(( $(date +%s) - started ))"
} | tee "$OUT/summary.txt"
[ "$status_tests" = passed ] && [ "$status_bench" = ok ]
