"""The operator's CLI end to end: ``podium up`` -> a WorkerGroup script joins with
``init(address=...)`` -> ``podium status`` shows it -> ``podium logs`` shows a line it
printed -> worker output reached the script's terminal, prefixed -> ``podium down``
leaves no process behind (the script is SIGKILLed first, so its workers are still up).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.support.proctable import alive
from tests.support.waiting import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent('''
    import sys
    from podium import init
    from podium.controller import ResourcePool, ClassWithInitArgs, WorkerGroup
    from podium.worker import Worker, register, Dispatch

    class HelloWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def hello(self, word):
            print(f"{word} from rank {self.rank}", flush=True)
            print(f"complaint from rank {self.rank}", file=sys.stderr, flush=True)
            return self.rank

    init(address=sys.argv[1])
    # One GPU per node and one placement group per GPU: ranks span both nodes.
    pool = ResourcePool(process_on_nodes=[1, 1], use_gpu=True, max_colocate_count=1)
    wg = WorkerGroup(resource_pool=pool, ray_cls_with_init=ClassWithInitArgs(HelloWorker),
                     name_prefix=sys.argv[2])
    print("RESULT", wg.hello("hello"), " ".join(wg.worker_names), flush=True)
    sys.stdin.readline()  # the test looks at the cluster meanwhile, then kills us (or EOF)
''')


def _podium(*args: str, env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


class _Lines:
    """Lines of a text stream collected by a thread, so no read blocks the test."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait(self, predicate, timeout: float) -> list[str]:
        """The lines so far once ``predicate(lines)`` holds (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.lines):
            if time.monotonic() > deadline:
                raise AssertionError(f"not seen within {timeout}s; got {self.lines}")
            time.sleep(0.05)
        return list(self.lines)


def test_up_script_status_logs_down(tmp_path, token):
    state_dir = tmp_path / "local"
    env = dict(os.environ, PODIUM_TOKEN=token, PYTHONUNBUFFERED="1")
    env.pop("PODIUM_ADDRESS", None)
    up = _podium("up", "--dir", str(state_dir), "--nodes", "2", "--gpus-per-node", "1",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    cluster = json.loads((state_dir / "cluster.json").read_text())
    address = cluster["address"]
    assert f"PODIUM_ADDRESS={address}" in up.stdout
    assert [n["address"] for n in cluster["nodes"]] == ["127.0.0.2", "127.0.0.3"]
    daemons = [cluster["scheduler"]["pid"], *(n["pid"] for n in cluster["nodes"])]
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    job = None
    try:
        # With PODIUM_LOG_TO_DRIVER=0 the script's terminal gets none of its workers' lines.
        quiet = subprocess.run([sys.executable, str(script), address, "quiet"], input="",
                               env=dict(env, PODIUM_LOG_TO_DRIVER="0"), capture_output=True,
                               text=True, timeout=180)
        assert quiet.returncode == 0, quiet.stderr[-3000:]
        assert "RESULT [0, 1]" in quiet.stdout
        assert "HelloWorker rank=" not in quiet.stdout + quiet.stderr

        job = subprocess.Popen([sys.executable, str(script), address, "cli"], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        job_out = _Lines(job.stdout)
        out = job_out.wait(lambda lines: any(x.startswith("RESULT") for x in lines), 180)
        result = next(x for x in out if x.startswith("RESULT")).split()
        assert result[1:3] == ["[0,", "1]"], out
        names = result[3:]
        assert len(names) == 2

        status = _podium("status", "--dir", str(state_dir), env=env)
        assert status.returncode == 0, status.stderr
        text = status.stdout
        assert "2/2 nodes alive, 2 GPUs" in text
        for name in names:
            assert name in text
        assert "127.0.0.2" in text and "127.0.0.3" in text and "RUNNING" in text
        # The same through --address (any cluster), with the token from the environment.
        by_address = _podium("status", "--address", address, env=env)
        assert by_address.returncode == 0 and names[0] in by_address.stdout

        logs = _podium("logs", names[1], "--dir", str(state_dir), env=env)
        assert logs.returncode == 0, logs.stderr
        assert "hello from rank 1" in logs.stdout
        assert "complaint from rank 1" in logs.stderr
        missing = _podium("logs", "no-such-worker", "--dir", str(state_dir), env=env)
        assert missing.returncode == 1 and "no worker" in missing.stderr

        # log_to_driver: the script's own terminal got both workers' lines, prefixed.
        want = {"(HelloWorker rank=0, node=127.0.0.2) hello from rank 0",
                "(HelloWorker rank=1, node=127.0.0.3) hello from rank 1"}
        job_out.wait(lambda lines: want <= set(lines), 30)

        # Follow: ends by itself when the worker exits (the script is killed, then down).
        follow = subprocess.Popen([sys.executable, "-m", "podium.cli", "logs", names[0], "--follow",
                                   "--dir", str(state_dir)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        follow_out = _Lines(follow.stdout)
        follow_out.wait(lambda lines: "hello from rank 0" in lines, 60)
        workers = [int(line.split()[-2]) for line in text.splitlines()
                   if line.startswith(tuple(names)) and line.split()[-2].isdigit()]
        assert len(workers) == 2, text
        job.send_signal(signal.SIGKILL)
        job.wait(30)
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env, timeout=120)
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(30)
    assert down.returncode == 0, down.stderr
    assert "stopped 2 nodes" in down.stdout
    assert follow.wait(30) == 0
    eventually(lambda: not any(map(alive, daemons + workers)), "the daemons and their workers to exit", 10)
    assert not (state_dir / "cluster.json").exists()
    again = _podium("down", "--dir", str(state_dir), env=env)
    assert again.returncode == 0 and "no local cluster" in again.stderr
