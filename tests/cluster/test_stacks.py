"""Issue #32, item 2: live stacks of every rank (``podium.stacks``, ``podium stack``,
``GET /v1/stacks``) on a scheduler and two node agents as real processes.

A rank busy in a long method answers with that method's frame (its event loop answers, not
its execution thread); a SIGSTOPped rank is named "stopped" with the /proc state its node
agent reads; the HTTP endpoint and both RPCs want the token; the CLI prints the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

import podium
from podium import rpc
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.process import STATE_NAMES, kernel_state
from podium.v1 import node_pb2, node_pb2_grpc, worker_pb2, worker_pb2_grpc
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import two_node_processes
from tests.support.waiting import eventually

#: /proc states of a live, unstopped process (D: a moment of disk sleep on a loaded machine).
RUNNABLE = ("S", "R", "D")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


class Sleeper(Worker):
    """Sleeps in a method named so that its frame is easy to find."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep_in_method_for_stacks(self, seconds):
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_node_processes(tmp_path_factory.mktemp("stacks"), gpus_per_node=1) as procs:
        podium.init(address=procs.address, token=procs.token)
        try:
            rt = get_runtime()
            eventually(lambda: len(rt.run(rt.cluster_state()).nodes) == 2, "both agents registered")
            yield procs
        finally:
            podium.shutdown()


@pytest.fixture(scope="module")
def group(cluster):
    # One (fake) GPU per node: the pool's two placement groups land on different nodes.
    wg = WorkerGroup(ResourcePool([1, 1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Sleeper),
                     name_prefix="stk_")
    try:
        yield wg
    finally:
        wg.shutdown()


def _in_method(report) -> bool:
    return len(report) == 2 and all(
        r.answered and any("sleep_in_method_for_stacks" in t.stack for t in r.threads) for r in report)


def test_a_rank_inside_a_long_method_shows_that_frame(group):
    pending = group.sleep_in_method_for_stacks(20)
    report = eventually(lambda: (lambda r: r if _in_method(r) else None)(podium.stacks(group=group)),
                        "both ranks' stacks showing the sleeping method")
    assert [r.rank for r in report] == [0, 1]
    assert len({r.node for r in report}) == 2  # one rank per node: both agents answered
    pids = group.pid()
    for r in report:
        assert r.group == "stk_" and r.pid == pids[r.rank] and r.worker_id
        # A live rank: running, sleeping, or (on a loaded machine, for a moment) in disk sleep.
        assert r.state in RUNNABLE and r.state_name == STATE_NAMES[r.state]
        busy = [t for t in r.threads if "sleep_in_method_for_stacks" in t.stack][0]
        assert busy.name == "podium-exec" and "time.sleep(seconds)" in busy.stack
        assert any(t.name == "MainThread" for t in r.threads)
    text = str(report)
    assert "=== group stk_ rank 0" in text and "=== group stk_ rank 1" in text
    assert "--- thread podium-exec" in text and "sleep_in_method_for_stacks" in text
    assert podium.stacks(group=group, rank=1)[0].rank == 1
    assert podium.stacks(worker_id=report[0].worker_id)[0].worker_id == report[0].worker_id
    assert len(podium.stacks(group="no-such-group")) == 0
    del pending


def test_a_stopped_rank_is_named_with_its_proc_state(group):
    pids = group.pid()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        # The kernel stops it when it next runs: on a loaded machine that can take a moment.
        eventually(lambda: kernel_state(pids[1])[0] == "T", "rank 1 stopped by the kernel")
        report = podium.stacks(group=group, timeout=1.0)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    by_rank = {r.rank: r for r in report}
    stopped = by_rank[1]
    assert not stopped.answered and stopped.threads == []
    assert stopped.state == "T" and stopped.state_name == "stopped" and stopped.pid == pids[1]
    assert "did not answer" in stopped.error and "SIGCONT" in stopped.error
    assert "T (stopped)" in str(stopped) and "no stacks:" in str(stopped)
    assert by_rank[0].answered and by_rank[0].threads
    # Continued, it answers again.
    eventually(lambda: podium.stacks(group=group, rank=1)[0].answered, "rank 1 answering after SIGCONT")


def _get(url: str, token: str | None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_the_http_endpoint_wants_the_token_and_answers_with_it(cluster, group):
    base = f"http://127.0.0.1:{cluster.http_port}/v1/stacks"
    assert _get(f"{base}?group=stk_", None)[0] == 401
    assert _get(f"{base}?group=stk_", "wrong-token")[0] == 401
    status, body = _get(f"{base}?group=stk_&rank=0", cluster.token)
    assert status == 200, body
    (only,) = body["workers"]
    assert only["rank"] == 0 and only["group"] == "stk_" and only["answered"] is True
    assert only["state"] in RUNNABLE and any(t["name"] == "MainThread" for t in only["threads"])
    assert _get(f"{base}?rank=zero", cluster.token)[0] == 400
    assert _get(f"{base}?timeout=1e9", cluster.token)[0] == 400
    status, body = _get(f"{base}?group=stk_", cluster.token)
    assert status == 200 and [w["rank"] for w in body["workers"]] == [0, 1]


def test_the_cli_prints_the_stacks(cluster, group):
    env = dict(os.environ, PODIUM_TOKEN=cluster.token)
    env.pop("PODIUM_TOKEN_FILE", None)
    done = subprocess.run([sys.executable, "-m", "podium.cli", "stack", "--address", cluster.address,
                           "--group", "stk_"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "=== group stk_ rank 0" in done.stdout and "=== group stk_ rank 1" in done.stdout
    assert "--- thread MainThread" in done.stdout
    done = subprocess.run([sys.executable, "-m", "podium.cli", "stack", "--address", cluster.address,
                           "--rank", "1", "--group", "stk_", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [w["rank"] for w in json.loads(done.stdout)["workers"]] == [1]
    env["PODIUM_TOKEN"] = "wrong-token"
    done = subprocess.run([sys.executable, "-m", "podium.cli", "stack", "--address", cluster.address],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "podium stack:" in done.stderr


def test_both_rpcs_want_the_token_and_the_agent_reads_only_its_own_workers(cluster, group):
    rt = get_runtime()
    info = [w for w in rt.run(rt.cluster_state()).workers if w.spec.group == "stk_" and w.spec.rank == 0][0]
    agent = cluster.agent_addresses[info.node_address]

    async def ask(token: str):
        worker = rpc.make_channel(f"{info.node_address}:{info.port}", token)
        node = rpc.make_channel(agent, token)
        out = []
        try:
            for call in (lambda: worker_pb2_grpc.WorkerStub(worker).Stacks(worker_pb2.StacksRequest(), timeout=10),
                         lambda: node_pb2_grpc.NodeAgentStub(node).ProcessStates(
                             node_pb2.ProcessStatesRequest(worker_ids=[info.id, "w-nobody"]), timeout=10)):
                try:
                    out.append(await call())
                except grpc.aio.AioRpcError as exc:
                    out.append(exc.code())
        finally:
            await worker.close()
            await node.close()
        return out

    assert asyncio.run(ask("wrong-token")) == [grpc.StatusCode.UNAUTHENTICATED] * 2
    stacks, states = asyncio.run(ask(cluster.token))
    assert stacks.worker_id == info.id and stacks.rank == 0 and stacks.threads
    mine, nobody = states.states
    assert mine.worker_id == info.id and mine.pid == info.pid and mine.state in RUNNABLE
    assert nobody.worker_id == "w-nobody" and nobody.state == "" and nobody.state_name == "unknown worker"
    assert asyncio.run(_bad_max_frames(info, cluster.token)) == grpc.StatusCode.INVALID_ARGUMENT


async def _bad_max_frames(info, token):
    channel = rpc.make_channel(f"{info.node_address}:{info.port}", token)
    try:
        await worker_pb2_grpc.WorkerStub(channel).Stacks(worker_pb2.StacksRequest(max_frames=10**6), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()
    return None
