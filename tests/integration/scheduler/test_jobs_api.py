"""Ray's Jobs REST API on a real scheduler (in this process, real HTTP, real driver processes),
spoken with a plain HTTP client: what Ray's clients send, checked field by field.

The drivers here are shell commands and small Python programs (``import ray`` is the stand-in
under the job's ``podium run``); the real ``ray job`` CLI and drivers that use the cluster are
in tests/cluster/test_jobs_rayclient.py and test_jobs_podium_cli.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import aiohttp
import pytest

from podium.cli.job import zip_folder
from podium.scheduler import jobs as jobs_module
from podium.scheduler import jobshttp
from podium.scheduler.server import run_scheduler
from tests.support.httpattack import declared_body, endless_chunked_post
from tests.support.proctable import alive, members_of_groups
from tests.support.scheduler_fakes import config

pytestmark = pytest.mark.timeout(240)

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


async def _wait_status(http, base, job_id, statuses, timeout=90.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with http.get(f"{base}/api/jobs/{job_id}") as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        if doc["status"] in statuses:
            return doc
        assert loop.time() < deadline, f"job {job_id} still {doc['status']}, waiting for {statuses}"
        await asyncio.sleep(0.1)


async def _upload(http, base, folder) -> str:
    name, data = zip_folder(folder)
    async with http.get(f"{base}/api/packages/gcs/{name}") as resp:
        assert resp.status == 404
    async with http.put(f"{base}/api/packages/gcs/{name}", data=data) as resp:
        assert resp.status == 200, await resp.text()
    async with http.get(f"{base}/api/packages/gcs/{name}") as resp:
        assert resp.status == 200
    return f"gcs://{name}"


def test_without_the_token_every_endpoint_answers_401_and_nothing_runs(token, arun):
    async def scenario():
        running = await run_scheduler(config(token))
        base = running.http_url
        name = "_ray_pkg_0123456789abcdef.zip"
        calls = [("GET", "/api/version", None), ("GET", f"/api/packages/gcs/{name}", None),
                 ("PUT", f"/api/packages/gcs/{name}", b"PK" + bytes(100)),
                 ("POST", "/api/jobs/", b'{"entrypoint": "touch /tmp/never"}'), ("GET", "/api/jobs/", None),
                 ("GET", "/api/jobs/x", None), ("GET", "/api/jobs/x/logs", None),
                 ("GET", "/api/jobs/x/logs/tail", None), ("POST", "/api/jobs/x/stop", None),
                 ("DELETE", "/api/jobs/x", None)]
        try:
            async with aiohttp.ClientSession() as http:
                for headers in ({}, {"Authorization": f"Bearer {token}x"}, {"X-Ray-Authorization": "Bearer no"},
                                {"Cookie": "ray-authentication-token=no"}):
                    for method, path, body in calls:
                        async with http.request(method, base + path, data=body, headers=headers) as resp:
                            assert resp.status == 401, (method, path, headers, resp.status)
                assert not running.jobs.jobs
                assert not list(running.jobs.packages.folder.iterdir())
                # Ray's own token auth's header and cookie carry the same token.
                for headers in ({"X-Ray-Authorization": f"Bearer {token}"},
                                {"Cookie": f"ray-authentication-token={token}"}):
                    async with http.get(base + "/api/jobs/", headers=headers) as resp:
                        assert resp.status == 200 and await resp.json() == []
        finally:
            await running.stop()
    arun(scenario(), timeout=60)


def test_submit_run_logs_and_errors_the_ray_way(token, arun, tmp_path):
    work = tmp_path / "wd"
    work.mkdir()
    (work / "helper.py").write_text("WORD = 'from the working dir'\n")
    (work / "main.py").write_text(textwrap.dedent("""
        import os, ray, helper
        print(helper.WORD, os.environ["WHO"], os.environ["RAY_JOB_ID"], os.environ["PODIUM_ADDRESS"],
              getattr(ray, "__podium__", False), os.getcwd(), flush=True)
    """))

    async def scenario():
        running = await run_scheduler(config(token))
        base = running.http_url
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                async with http.get(base + "/api/version") as resp:
                    version = await resp.json()
                assert version["version"] == "4" and version["ray_version"] == "2.60.0"
                uri = await _upload(http, base, work)
                body = {"entrypoint": "python main.py", "submission_id": "ok-1", "metadata": {"who": "test"},
                        "runtime_env": {"working_dir": uri, "env_vars": {"WHO": "tester"}}}
                async with http.post(base + "/api/jobs/", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert await resp.json() == {"job_id": "ok-1", "submission_id": "ok-1"}
                async with http.post(base + "/api/jobs/", json=body) as resp:  # the same id again
                    assert resp.status == 400 and "already exists" in await resp.text()
                done = await _wait_status(http, base, "ok-1", TERMINAL)
                assert done["status"] == "SUCCEEDED", done
                assert done["driver_exit_code"] == 0 and done["end_time"] >= done["start_time"]
                assert done["metadata"] == {"who": "test"} and done["runtime_env"]["working_dir"] == uri
                async with http.get(base + "/api/jobs/ok-1/logs") as resp:
                    logs = (await resp.json())["logs"]
                assert f"from the working dir tester ok-1 {running.address} True" in logs
                assert logs.strip().endswith("working_dir")
                # The tail of an ended job: everything, then a normal close.
                async with http.ws_connect(base + "/api/jobs/ok-1/logs/tail") as ws:
                    frames = [msg.data async for msg in ws]
                    assert ws.close_code == aiohttp.WSCloseCode.OK
                assert "".join(frames) == logs

                # A failing entrypoint: FAILED with its exit code and the end of its output.
                async with http.post(base + "/api/jobs/", json={"entrypoint": "echo oops; exit 3"}) as resp:
                    failed_id = (await resp.json())["submission_id"]
                assert failed_id.startswith("raysubmit_")
                failed = await _wait_status(http, base, failed_id, TERMINAL)
                assert (failed["status"], failed["driver_exit_code"], failed["error_type"]) == (
                    "FAILED", 3, "JOB_ENTRYPOINT_COMMAND_ERROR")
                assert "exit code 3" in failed["message"] and "oops" in failed["message"]
                # A command that does not exist fails the same way (the shell's 127).
                async with http.post(base + "/api/jobs/", json={"entrypoint": "no-such-command-here"}) as resp:
                    missing = await _wait_status(http, base, (await resp.json())["submission_id"], TERMINAL)
                assert missing["status"] == "FAILED" and missing["driver_exit_code"] == 127

                # Bad input and unknown ids: Ray's codes, plain text, nothing recorded.
                for body, code, words in (
                        ({"entrypoint": ""}, 400, "entrypoint is empty"),
                        ({"entrypoint": "x", "runtime_env": {"working_dir": "gcs://_ray_pkg_00000000000000ff.zip"}},
                         400, "upload it first"),
                        ({"entrypoint": "x", "runtime_env": {"conda": "env"}}, 400, "conda is not supported"),
                        ({"entrypoint": "x", "runtime_env": {"pip": "requirements.txt"}}, 400, "does not read"),
                        ({"entrypoint": "x", "entrypoint_memory": 10}, 400, "entrypoint_memory is not supported")):
                    async with http.post(base + "/api/jobs/", json=body) as resp:
                        assert resp.status == code and words in await resp.text(), (body, resp.status)
                async with http.post(base + "/api/jobs/", data=b"{not json",
                                     headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 400
                for method, path in (("GET", "/api/jobs/nope"), ("GET", "/api/jobs/nope/logs"),
                                     ("POST", "/api/jobs/nope/stop"), ("DELETE", "/api/jobs/nope"),
                                     ("GET", "/api/jobs/nope/logs/tail")):
                    async with http.request(method, base + path) as resp:
                        assert resp.status == 404 and "does not exist" in await resp.text(), (method, path)
                # More CPUs than this machine: placed on a node; with no node yet it waits PENDING
                # (as a placement group does), and a stop drops its reservation.
                async with http.post(base + "/api/jobs/", json={"entrypoint": "x", "submission_id": "big",
                                                                "entrypoint_num_cpus": 10**6}) as resp:
                    assert resp.status == 200, await resp.text()
                async with http.get(base + "/api/jobs/big") as resp:
                    assert (await resp.json())["status"] == "PENDING"
                async with http.post(base + "/api/jobs/big/stop") as resp:
                    assert (await resp.json())["stopped"] is True
                assert (await _wait_status(http, base, "big", TERMINAL))["status"] == "STOPPED"
                async with http.get(base + "/api/jobs/") as resp:
                    listed = {j["submission_id"]: j["status"] for j in await resp.json()}
                assert listed == {"ok-1": "SUCCEEDED", failed_id: "FAILED", missing["submission_id"]: "FAILED",
                                  "big": "STOPPED"}
                async with http.get(base + "/metrics") as resp:
                    metrics = await resp.text()
                assert 'podium_scheduler_jobs{status="FAILED"} 2.0' in metrics
                assert 'podium_scheduler_jobs{status="SUCCEEDED"} 1.0' in metrics

                # Stopping an ended job is a no-op that says so; deleting forgets it.
                async with http.post(base + "/api/jobs/ok-1/stop") as resp:
                    assert resp.status == 200 and await resp.json() == {"stopped": False}
                async with http.delete(base + "/api/jobs/ok-1") as resp:
                    assert await resp.json() == {"deleted": True}
                async with http.get(base + "/api/jobs/ok-1") as resp:
                    assert resp.status == 404
        finally:
            await running.stop()
    arun(scenario(), timeout=200)


def test_stop_kills_the_whole_group_and_bounds_hold(token, arun, monkeypatch):
    monkeypatch.setattr(jobs_module, "MAX_LIVE_JOBS", 2)
    monkeypatch.setattr(jobshttp, "MAX_PACKAGE_BYTES", 1000)
    # A driver whose child ignores SIGTERM: only the SIGKILL after the grace ends it.
    stubborn = "sh -c 'trap \"\" TERM; while true; do sleep 1; done' & echo started; wait"

    async def scenario():
        running = await run_scheduler(config(token))
        running.jobs.grace = 1.0
        base = running.http_url
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                async with http.post(base + "/api/jobs/", json={"entrypoint": stubborn, "submission_id": "s"}) as resp:
                    assert resp.status == 200
                async with http.post(base + "/api/jobs/", json={"entrypoint": "sleep 300", "submission_id": "t"}) as resp:
                    assert resp.status == 200
                async with http.post(base + "/api/jobs/", json={"entrypoint": "true"}) as resp:
                    assert resp.status == 429 and "PENDING or RUNNING" in await resp.text()
                # A package over the bound: 413 before its body is read, the connection closed.
                async with http.put(base + "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip",
                                    data=bytes(5000)) as resp:
                    assert resp.status == 413
                async with http.put(base + "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip",
                                    data=b"not a zip") as resp:
                    assert resp.status == 400 and "not a zip" in await resp.text()
                running_job = await _wait_status(http, base, "s", {"RUNNING"})
                pgid = int(running_job["driver_info"]["pid"])
                for _ in range(100):
                    if len(members_of_groups({pgid})) >= 3:  # podium run, sh, the stubborn child
                        break
                    await asyncio.sleep(0.1)
                async with http.delete(base + "/api/jobs/s") as resp:  # live: refused
                    assert resp.status == 400 and "non-terminal" in await resp.text()
                async with http.post(base + "/api/jobs/s/stop") as resp:
                    assert await resp.json() == {"stopped": True}
                stopped = await _wait_status(http, base, "s", TERMINAL, timeout=30)
                assert stopped["status"] == "STOPPED" and stopped["message"] == "Job was intentionally stopped."
                for _ in range(100):  # SIGKILLed already: gone as soon as the kernel has them exit
                    if not members_of_groups({pgid}):
                        break
                    await asyncio.sleep(0.05)
                assert members_of_groups({pgid}) == []
                assert not alive(pgid)
                # Stopping the scheduler stops its running jobs too.
                other = await _wait_status(http, base, "t", {"RUNNING"})
                # A follower of a silent job that goes away is not followed on.
                follows = running.jobs.log_of(running.jobs.get("t"))
                async with http.ws_connect(base + "/api/jobs/t/logs/tail"):
                    for _ in range(100):
                        if follows.followers == 1:
                            break
                        await asyncio.sleep(0.05)
                    assert follows.followers == 1
                for _ in range(100):
                    if follows.followers == 0:
                        break
                    await asyncio.sleep(0.05)
                assert follows.followers == 0
        finally:
            await running.stop()
        for _ in range(100):
            if not alive(int(other["driver_info"]["pid"])):
                break
            await asyncio.sleep(0.05)
        assert not alive(int(other["driver_info"]["pid"]))
        assert running.jobs.jobs["t"].status == "FAILED"
        assert "scheduler stopped" in running.jobs.jobs["t"].message
    arun(scenario(), timeout=200)


def test_records_survive_a_restart(token, arun, tmp_path):
    state = str(tmp_path / "state.db")

    async def scenario():
        running = await run_scheduler(config(token, state=state))
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                async with http.post(running.http_url + "/api/jobs/", json={"entrypoint": "echo kept",
                                                                           "submission_id": "a"}) as resp:
                    assert resp.status == 200
                await _wait_status(http, running.http_url, "a", TERMINAL)
                async with http.post(running.http_url + "/api/jobs/", json={"entrypoint": "sleep 300",
                                                                           "submission_id": "b"}) as resp:
                    assert resp.status == 200
                await _wait_status(http, running.http_url, "b", {"RUNNING"})
        finally:
            await running.stop()
        again = await run_scheduler(config(token, state=state))
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                done = await _wait_status(http, again.http_url, "a", TERMINAL)
                assert done["status"] == "SUCCEEDED"
                async with http.get(again.http_url + "/api/jobs/a/logs") as resp:
                    assert (await resp.json())["logs"] == "kept\n"
                b = await _wait_status(http, again.http_url, "b", TERMINAL)
                assert b["status"] == "FAILED" and b["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
                assert "scheduler stopped" in b["message"]
        finally:
            await again.stop()
    arun(scenario(), timeout=120)


def test_no_body_is_read_before_the_token_or_past_its_bound(token, arun):
    """Submit and upload take bodies (their own bounds); still, without the token nothing of a
    body is read (401, the connection closed), and a chunked or oversized one is cut off (413)."""
    package = "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip"

    async def scenario():
        running = await run_scheduler(config(token))
        loop = asyncio.get_running_loop()
        host, port = running.host, running.http_port
        try:
            attacks = [("PUT", package, 200 << 20, "", b"401"), ("POST", "/api/jobs/", 512 << 10, "", b"401"),
                       ("POST", "/api/jobs/", 64 << 20, f"Authorization: Bearer {token}\r\n", b"413"),
                       ("PUT", package, 1 << 40, f"Authorization: Bearer {token}\r\n", b"413")]
            for method, path, length, headers, code in attacks:
                status, sent = await loop.run_in_executor(
                    None, declared_body, host, port, method, path, length, 256 << 20, headers)
                assert status.startswith(b"HTTP/1.1 " + code), (method, path, status)
                assert sent < 16 << 20, (method, path, sent)  # what the socket buffers took
            for method, path in (("PUT", package), ("POST", "/api/jobs/")):
                status, sent = await loop.run_in_executor(
                    None, endless_chunked_post, host, port, path, 256 << 20, method,
                    f"Authorization: Bearer {token}\r\n")
                assert status.startswith(b"HTTP/1.1 413") and sent < 16 << 20, (method, status, sent)
            assert not running.jobs.jobs and not list(running.jobs.packages.folder.iterdir())
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                async with http.get(running.http_url + "/api/jobs/") as resp:  # still serving
                    assert resp.status == 200
        finally:
            await running.stop()
    arun(scenario(), timeout=120)


def test_under_mutual_tls_the_driver_and_podium_job_use_it(token, arun, tls, tmp_path):
    """With TLS the jobs API is HTTPS with a client certificate, `podium job` reads the
    PODIUM_TLS_* files, and the driver gets them with the address and token, which is what
    its controller reaches the scheduler with (no node here: a cluster-state call)."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import asyncio, os
        from podium.auth import TlsConfig
        from podium.scheduler.client import SchedulerClient

        async def main():
            tls = TlsConfig.from_paths(os.environ["PODIUM_TLS_CERT"], os.environ["PODIUM_TLS_KEY"],
                                       os.environ["PODIUM_TLS_CA"])
            async with SchedulerClient(os.environ["PODIUM_ADDRESS"], os.environ["PODIUM_TOKEN"], tls) as client:
                print("JOINED", len((await client.cluster_state()).nodes))
        asyncio.run(main())
    """))
    driver = ["python", str(script)]

    async def scenario():
        running = await run_scheduler(config(token, tls=tls))
        assert running.http_url.startswith("https://")
        env = dict(os.environ, PODIUM_TOKEN=token, PODIUM_TLS_CERT=tls.cert, PODIUM_TLS_KEY=tls.key,
                   PODIUM_TLS_CA=tls.ca)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "podium.cli", "job", "submit", "--address", running.http_url,
                "--submission-id", "tls", "--", *driver, env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
            out = (await asyncio.wait_for(proc.communicate(), 120))[0].decode()
            assert proc.returncode == 0, out
            assert "JOINED 0" in out and "Job 'tls' succeeded" in out
            plain = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "podium.cli", "job", "list", "--address", running.http_url,
                env=dict(env, PODIUM_TLS_CERT="", PODIUM_TLS_KEY="", PODIUM_TLS_CA=""),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out = (await asyncio.wait_for(plain.communicate(), 60))[0].decode()
            assert plain.returncode == 1, out  # no client certificate: refused
        finally:
            await running.stop()
    arun(scenario(), timeout=180)


def test_entrypoint_cpus_queue_jobs_until_they_fit(token, arun):
    async def scenario():
        running = await run_scheduler(config(token))
        running.jobs.cpus = 2.0  # the machine's CPUs, as the jobs count them
        running.jobs.grace = 1.0
        base = running.http_url
        try:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                for job_id, cpus in (("big", 2), ("small", 1), ("queued", 1)):
                    body = {"entrypoint": "sleep 300", "submission_id": job_id, "entrypoint_num_cpus": cpus}
                    async with http.post(base + "/api/jobs/", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                # More than the machine has: placed on a node (none here: it waits for one).
                async with http.post(base + "/api/jobs/", json={"entrypoint": "true", "entrypoint_num_cpus": 3,
                                                                "submission_id": "placed"}) as resp:
                    assert resp.status == 200, await resp.text()
                async with http.post(base + "/api/jobs/placed/stop") as resp:
                    assert await resp.json() == {"stopped": True}
                assert (await _wait_status(http, base, "placed", TERMINAL))["status"] == "STOPPED"
                await _wait_status(http, base, "big", {"RUNNING"})
                small = await _wait_status(http, base, "small", {"PENDING"})
                assert small["driver_info"] is None and "waiting for resources" in small["message"]
                # A job stopped while it waits ends at once; one that ends lets the next start.
                async with http.post(base + "/api/jobs/queued/stop") as resp:
                    assert await resp.json() == {"stopped": True}
                queued = await _wait_status(http, base, "queued", TERMINAL)
                assert queued["status"] == "STOPPED" and queued["driver_info"] is None
                async with http.post(base + "/api/jobs/big/stop") as resp:
                    assert await resp.json() == {"stopped": True}
                await _wait_status(http, base, "small", {"RUNNING"})
        finally:
            await running.stop()
    arun(scenario(), timeout=120)
