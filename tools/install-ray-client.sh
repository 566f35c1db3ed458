#!/usr/bin/env bash
# Make .venv-ray: the real Ray 2.60 job client (`ray job ...`, JobSubmissionClient) in a
# virtualenv of its own, for the `rayclient` tests (tests/cluster/test_jobs_rayclient.py), which
# submit jobs with it to a Podium cluster. Podium itself is not installed here: the cluster and
# the drivers run in Podium's environment, and there `import ray` is Podium's stand-in.
# ray[default] is what `ray job` needs (its CLI imports the dashboard's SDK: aiohttp, pydantic,
# requests). Usage: tools/install-ray-client.sh [VENV_DIR]   (default .venv-ray; ~2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-ray}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "ray[default]==2.60.0"
"$venv/bin/ray" job --help >/dev/null
"$venv/bin/python" -c "import ray; from ray.job_submission import JobSubmissionClient; print('ray', ray.__version__, 'job client ready in', '$venv')"
