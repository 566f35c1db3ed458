"""Submitting jobs to a cluster's HTTP port: how long a submission with a 10 MiB working dir
takes, and how long reading the status of 100 jobs takes (issue 50's goals: at most 1 s and
50 ms).

    python -m bench.jobs_bench [--mib 10] [--repeat 5] [--jobs 100] [--ray-python .venv-ray/bin/python]

It starts one ``podium scheduler`` process (a state file in a temporary folder, no nodes: the
drivers here are ``true``) and measures, as a client on the same machine over loopback:

* ``submit``: a fresh working dir of ``--mib`` MiB of random bytes (incompressible, in 4
  files) each time, so it is zipped and uploaded every time: zip + ``GET`` (is it there?) +
  ``PUT`` + ``POST /api/jobs/``, as ``podium job submit --working-dir`` does, and split in
  those steps; with ``--ray-python``, Ray 2.60's own ``JobSubmissionClient.submit_job``
  (its own zip and hash) on the same kind of folder;
* ``status``: with ``--jobs`` jobs recorded (submitted, run and ended), one ``GET
  /api/jobs/`` listing them all, and the ``--jobs`` ``GET /api/jobs/{id}`` calls of a client
  polling each, one after the other on one connection.

Each figure is the median of ``--repeat`` runs (the listing: of 50), after one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

from podium.cli.job import zip_folder


def _fresh_dir(root: Path, mib: int, index: int) -> Path:
    folder = root / f"wd-{index}"
    folder.mkdir()
    per_file = mib * 1024 * 1024 // 4
    for part in range(4):
        (folder / f"blob{part}.bin").write_bytes(os.urandom(per_file))
    (folder / "main.py").write_text("print('hello')\n")
    return folder


async def _submit_once(http, base: str, folder: Path, headers: dict) -> dict:
    t0 = time.perf_counter()
    name, data = zip_folder(folder)
    t1 = time.perf_counter()
    async with http.get(f"{base}/api/packages/gcs/{name}", headers=headers) as resp:
        assert resp.status == 404
    async with http.put(f"{base}/api/packages/gcs/{name}", data=data, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    t2 = time.perf_counter()
    body = {"entrypoint": "true", "runtime_env": {"working_dir": f"gcs://{name}"}}
    async with http.post(f"{base}/api/jobs/", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        job = (await resp.json())["submission_id"]
    t3 = time.perf_counter()
    return {"job": job, "zip_ms": 1000 * (t1 - t0), "upload_ms": 1000 * (t2 - t1),
            "post_ms": 1000 * (t3 - t2), "total_ms": 1000 * (t3 - t0), "zip_bytes": len(data)}


async def _wait_all_ended(http, base: str, headers: dict, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(f"{base}/api/jobs/", headers=headers) as resp:
            jobs = await resp.json()
        if all(j["status"] in ("SUCCEEDED", "FAILED", "STOPPED") for j in jobs):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("jobs did not end")
        await asyncio.sleep(0.5)


async def _measure(base: str, token: str, args: argparse.Namespace, root: Path) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    out: dict = {}
    async with aiohttp.ClientSession() as http:
        runs = [await _submit_once(http, base, _fresh_dir(root, args.mib, i), headers)
                for i in range(args.repeat + 1)][1:]
        out["submit"] = {key: round(statistics.median(r[key] for r in runs), 1)
                         for key in ("zip_ms", "upload_ms", "post_ms", "total_ms")}
        out["submit"]["max_total_ms"] = round(max(r["total_ms"] for r in runs), 1)
        out["submit"]["zip_bytes"] = runs[0]["zip_bytes"]
        await _wait_all_ended(http, base, headers)
        # Top up to --jobs records, in waves under the live-job bound.
        async with http.get(f"{base}/api/jobs/", headers=headers) as resp:
            have = len(await resp.json())
        while have < args.jobs:
            wave = min(args.jobs - have, 32)
            for _ in range(wave):
                async with http.post(f"{base}/api/jobs/", json={"entrypoint": "true"}, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
            have += wave
            await _wait_all_ended(http, base, headers)
        async with http.get(f"{base}/api/jobs/", headers=headers) as resp:
            ids = [j["submission_id"] for j in await resp.json()][:args.jobs]
        listing, polls = [], []
        for _ in range(51):
            start = time.perf_counter()
            async with http.get(f"{base}/api/jobs/", headers=headers) as resp:
                await resp.read()
            listing.append(1000 * (time.perf_counter() - start))
        for _ in range(args.repeat + 1):
            start = time.perf_counter()
            for job in ids:
                async with http.get(f"{base}/api/jobs/{job}", headers=headers) as resp:
                    await resp.read()
            polls.append(1000 * (time.perf_counter() - start))
        out["status"] = {"jobs": len(ids), "list_all_ms": round(statistics.median(listing[1:]), 2),
                         "get_each_ms": round(statistics.median(polls[1:]), 1)}
    return out


_RAY_CHILD = textwrap.dedent('''
    import json, os, statistics, sys, time
    from ray.job_submission import JobSubmissionClient
    base, token, root, mib, repeat = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    client = JobSubmissionClient(base, headers={"Authorization": "Bearer " + token})
    times = []
    for i in range(repeat + 1):
        folder = os.path.join(root, f"ray-wd-{i}")
        os.makedirs(folder)
        for part in range(4):
            with open(os.path.join(folder, f"blob{part}.bin"), "wb") as f:
                f.write(os.urandom(mib * 1024 * 1024 // 4))
        start = time.perf_counter()
        client.submit_job(entrypoint="true", runtime_env={"working_dir": folder})
        times.append(1000 * (time.perf_counter() - start))
    print(json.dumps({"total_ms": round(statistics.median(times[1:]), 1), "max_total_ms": round(max(times[1:]), 1)}))
''')


def main(argv: list[str] | None = None) -> int:
    """Run the bench; prints one JSON document."""
    p = argparse.ArgumentParser(prog="python -m bench.jobs_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=10, help="working dir size (10 MiB)")
    p.add_argument("--repeat", type=int, default=5, help="submissions timed (5)")
    p.add_argument("--jobs", type=int, default=100, help="jobs whose status is read (100)")
    p.add_argument("--ray-python", default=None, help="an interpreter with Ray 2.60 (e.g. .venv-ray/bin/python)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="podium-jobs-bench-") as tmp:
        root = Path(tmp)
        token = "bench-token"
        port_file = root / "ports.json"
        env = dict(os.environ, PODIUM_TOKEN=token)
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "podium.cli", "scheduler", "--port", "0", "--http-port", "0", "--state",
             str(root / "state.db"), "--port-file", str(port_file), "--log-level", "WARNING"], env=env)
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if scheduler.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the scheduler did not start")
                time.sleep(0.05)
            base = f"http://127.0.0.1:{json.loads(port_file.read_text())['http_port']}"
            result = asyncio.run(_measure(base, token, args, root))
            if args.ray_python:
                child = subprocess.run([args.ray_python, "-c", _RAY_CHILD, base, token, str(root), str(args.mib),
                                        str(args.repeat)], capture_output=True, text=True, timeout=600,
                                       env={k: v for k, v in env.items() if not k.startswith("RAY_")})
                result["ray_client_submit"] = (json.loads(child.stdout.strip().splitlines()[-1])
                                               if child.returncode == 0 else {"error": child.stderr[-2000:]})
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=60)
    result.update({"mib": args.mib, "repeat": args.repeat, "cpus": os.cpu_count()})
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
