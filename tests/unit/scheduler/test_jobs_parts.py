"""The parts of submitted jobs that need no server: a submit body's checks (a pip/uv set among
them), a failed runtime_env setup told from a failed entrypoint, the driver's command and
variables with a pip set, the CLI reading a requirements file, the package checks (sizes, paths,
links), unpacking, the package store's bound, the log's bound and follower."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import stat
import zipfile

import pytest

from podium import errors
from podium.cli.job import _read_requirements, zip_folder
from podium.runtimeenv import ENV_KEY, SETUP_FAILED_EXIT, SETUP_FAILED_LINE, driver_command, driver_env
from podium import zippackage
from podium.scheduler.joblog import JobLog
from podium.scheduler.jobpackages import PackageStore, check_zip, package_name_of, unpack
from podium.scheduler.jobrecords import FAILED, PENDING, JobRecord, failure_of, parse_submit, pip_of

NAME = "_ray_pkg_0123456789abcdef.zip"


def _zip(entries: dict[str, bytes], links: dict[str, str] = {}) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        for name, target in links.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, target)
    return buffer.getvalue()


def test_submit_body_checks_name_the_problem():
    ok = parse_submit({"entrypoint": "python x.py", "submission_id": "run-1", "metadata": {"a": "b"},
                       "runtime_env": {"working_dir": "gcs://" + NAME, "env_vars": {"K": "V"}},
                       "entrypoint_num_cpus": 1, "entrypoint_num_gpus": None})
    assert ok.submission_id == "run-1" and ok.runtime_env["env_vars"] == {"K": "V"}
    bad = [({}, "missing field entrypoint"), ({"entrypoint": "  "}, "entrypoint is empty"),
           ({"entrypoint": 3}, "must be a string"), ([], "JSON object"),
           ({"entrypoint": "x", "submission_id": "../etc"}, "submission_id"),
           ({"entrypoint": "x", "nope": 1}, "unexpected field"),
           ({"entrypoint": "x", "runtime_env": {"conda": "env"}}, "conda is not supported"),
           ({"entrypoint": "x", "runtime_env": {"pip": ["a"], "uv": ["b"]}}, "sets pip and uv: give one"),
           ({"entrypoint": "x", "runtime_env": {"pip": ["a"], "py_executable": "python"}},
            "sets pip and py_executable"),
           ({"entrypoint": "x", "runtime_env": {"pip": "requirements.txt"}}, "does not read"),
           ({"entrypoint": "x", "runtime_env": {"uv": {"packages": "r.txt"}}}, "does not read"),
           ({"entrypoint": "x", "runtime_env": {"pip": [str(i) for i in range(300)]}}, "1 to 256"),
           ({"entrypoint": "x", "runtime_env": {"pip": {"packages": ["a"], "extra": 1}}}, "not supported"),
           ({"entrypoint": "x", "runtime_env": {"pip": [3]}}, "list of requirements"),
           ({"entrypoint": "x", "runtime_env": {"uv": {"packages": ["a"], "uv_pip_install_options": ["-U"]}}},
            "takes only Ray's default"),
           ({"entrypoint": "x", "runtime_env": {"wat": 1}}, "not known"),
           ({"entrypoint": "x", "entrypoint_memory": 1}, "entrypoint_memory is not supported"),
           ({"entrypoint": "x", "entrypoint_num_cpus": -1}, ">= 0"),
           ({"entrypoint": "x", "metadata": {"k": 1}}, "must be a string"),
           ({"entrypoint": "x", "metadata": {str(i): "v" for i in range(65)}}, "at most 64")]
    for body, words in bad:
        with pytest.raises(errors.InvalidArgumentError, match=words):
            parse_submit(body)


def test_a_jobs_pip_set_in_rays_forms():
    # The list form, and the dicts Ray's job client sends (RuntimeEnv.to_dict adds pip_check/uv_check
    # and, for uv, its default install options).
    for key, value in (("pip", ["b==1", " a ", "b==1"]), ("pip", {"packages": ["a", "b==1"], "pip_check": False}),
                       ("uv", {"packages": ["a", "b==1"], "uv_check": False, "uv_pip_install_options": ["--no-cache"]}),
                       ("pip", {"packages": ["a", "b==1"], "pip_check": False,
                                "pip_install_options": ["--disable-pip-version-check", "--no-cache-dir"]})):
        request = parse_submit({"entrypoint": "python x.py", "runtime_env": {key: value}})
        assert request.runtime_env[key] == value  # kept as given (the job's details show it)
        assert pip_of(request.runtime_env) == {"installer": key, "packages": ("a", "b==1"),
                                               "pip_check": False, "pip_version": ""}
    assert pip_of(None) is None and pip_of({"env_vars": {"A": "1"}}) is None


def test_a_failed_setup_is_told_from_a_failed_entrypoint():
    job = JobRecord(submission_id="j", entrypoint="python x.py", runtime_env={"pip": ["missing"]})
    tail = f"{SETUP_FAILED_LINE} pip install failed (exit 1): pip install -r req.txt\nERROR: No matching distribution"
    assert failure_of(job, SETUP_FAILED_EXIT, tail) == (
        "RUNTIME_ENV_SETUP_FAILURE", f"runtime_env setup failed, last available logs:\n{tail}")
    # The same exit status from the entrypoint itself, or a job without a set: the entrypoint's.
    for other, code, text in ((job, SETUP_FAILED_EXIT, "my own exit 78"), (job, 1, tail),
                              (JobRecord(submission_id="k", entrypoint="e"), SETUP_FAILED_EXIT, tail)):
        error_type, message = failure_of(other, code, text)
        assert error_type == "JOB_ENTRYPOINT_COMMAND_ERROR" and f"exit code {code}" in message


def test_a_drivers_command_and_variables_with_a_pip_set(tmp_path):
    pip = pip_of({"pip": ["a"]})
    plain = driver_command(tmp_path, None, ["/bin/sh", "-c", "python x.py"])
    assert plain == [sys.executable, "-m", "podium.cli", "run", "--", "/bin/sh", "-c", "python x.py"]
    launched = driver_command(tmp_path, pip, ["/bin/sh", "-c", "python x.py"])
    assert launched[:4] == [sys.executable, "-m", "podium.worker.agent.envlauncher", str(tmp_path)]
    assert json.loads(launched[4])["pip"]["packages"] == ["a"]
    assert launched[5:] == ["--", "-m", "podium.cli", "run", "--", "/bin/sh", "-c", "python x.py"]
    # The actors and tasks the driver creates inherit the set (as they inherit py_executable).
    assert json.loads(driver_env(None, pip)[ENV_KEY])["pip"]["packages"] == ["a"]
    assert json.loads(driver_env("python3", None)[ENV_KEY])["py_executable"] == ["python3"]
    assert driver_env(None, None) == {}


def test_the_cli_sends_a_requirements_files_lines(tmp_path, monkeypatch):
    (tmp_path / "requirements.txt").write_text("# pinned\nb==1\n\na\n")
    monkeypatch.chdir(tmp_path)
    assert _read_requirements({"pip": "requirements.txt"}) == {"pip": ["a", "b==1"]}
    assert _read_requirements({"uv": {"packages": str(tmp_path / "requirements.txt"), "uv_check": True}}) == {
        "uv": {"packages": ["a", "b==1"], "uv_check": True}}
    assert _read_requirements({"pip": ["c"], "env_vars": {}}) == {"pip": ["c"], "env_vars": {}}
    with pytest.raises(errors.InvalidArgumentError, match="cannot be read here"):
        _read_requirements({"pip": "absent.txt"})


def test_record_round_trip_and_ray_fields():
    job = JobRecord(submission_id="j", entrypoint="e")
    assert job.status == PENDING and job.message == "Job has not started yet."
    again = JobRecord.from_json({**job.to_json(), "added_later": 1})
    assert again == job
    details = JobRecord(submission_id="j", entrypoint="e", status=FAILED, pid=7).details()
    assert details["type"] == "SUBMISSION" and details["message"] == "Job failed."
    assert details["driver_info"]["pid"] == "7"
    assert {"job_id", "submission_id", "status", "entrypoint", "start_time", "end_time", "runtime_env",
            "driver_exit_code", "error_type", "metadata"} <= set(details)


def test_package_checks_refuse_escapes_links_and_bombs(tmp_path, monkeypatch):
    cases = {"escape": _zip({"../x": b"1"}), "absolute": _zip({"/etc/x": b"1"}),
             "link": _zip({"a": b"1"}, links={"b": "/etc/passwd"}), "junk": b"not a zip"}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(errors.InvalidArgumentError):
            check_zip(path)
    monkeypatch.setattr(zippackage, "MAX_UNPACKED_BYTES", 1000)
    big = tmp_path / "big"
    big.write_bytes(_zip({"zeros": bytes(2000)}))  # compresses to far less than it unpacks to
    with pytest.raises(errors.PayloadTooLargeError, match="unpacks to 2000 bytes"):
        check_zip(big)
    with pytest.raises(errors.InvalidArgumentError, match="not supported"):
        package_name_of("https://example.com/x.zip")


def test_unpack_and_the_clients_zip(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("echo hi\n")
    (src / "run.sh").chmod(0o755)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    (src / "skip.log").write_text("x")
    name, data = zip_folder(src, excludes=["*.log"])
    assert name == zip_folder(src, excludes=["*.log"])[0] and package_name_of("gcs://" + name) == name
    (tmp_path / name).write_bytes(data)
    unpack(tmp_path / name, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert (out / "run.sh").stat().st_mode & 0o100
    assert not (out / ".git").exists() and not (out / "skip.log").exists()


def test_store_keeps_within_its_bound_sparing_packages_in_use(tmp_path):
    store = PackageStore(tmp_path / "pkgs", max_stored_bytes=3000)
    names = [f"_ray_pkg_{i:016x}.zip" for i in range(3)]
    data = _zip({"f": bytes(range(256)) * 5})  # ~1.4 kB, stored uncompressed
    store.put("gcs", names[0], data)
    store.put("gcs", names[1], data)
    assert store.exists("gcs", names[0]) and store.exists("gcs", names[1])
    store.put("gcs", names[2], data, in_use={names[1]})
    assert not store.exists("gcs", names[0]) and store.exists("gcs", names[1])
    with pytest.raises(errors.PayloadTooLargeError, match="in use by live jobs"):
        store.put("gcs", "_ray_pkg_ffffffffffffffff.zip", data, in_use=set(names))
    with pytest.raises(errors.InvalidArgumentError):
        store.put("s3", NAME, data)
    with pytest.raises(errors.NotFoundError, match="upload it first"):
        store.require("gcs://_ray_pkg_eeeeeeeeeeeeeeee.zip")


def test_log_keeps_its_bound_and_a_follower_reads_across_a_rotation(tmp_path):
    async def scenario():
        log = JobLog(tmp_path, max_bytes=100)
        done = False
        got = []

        async def follow():
            async for text in log.follow(lambda: done, poll=0.05):
                got.append(text)
        follower = asyncio.get_running_loop().create_task(follow())
        for i in range(10):
            log.append(f"line {i:02d} ...\n".encode())  # 13 bytes each: rotates every 4
            await asyncio.sleep(0.01)
        done = True
        log.poke()
        await asyncio.wait_for(follower, 10)
        return log, "".join(got)
    log, text = asyncio.run(scenario())
    kept = log.read_all().decode()
    assert len(kept.encode()) <= 100 and kept.endswith("line 09 ...\n")
    assert [f"line {i:02d} ..." for i in range(10)] == text.splitlines()
