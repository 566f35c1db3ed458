"""The node agent against a recording scheduler: real gRPC servers on port 0, real processes.

The workers are ``agent_fake_worker.py``, which follows the same bootstrap
contract as ``podium.worker.host.process`` (ready fd, one JSON line) and can be told to
crash, ignore SIGTERM, or stay silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import grpc
import pytest

from podium import errors, rpc
from podium.worker.agent.ports import ephemeral_range
from podium.v1 import common_pb2, node_pb2
from podium.worker.agent.service import AgentConfig, run_agent
from podium.worker.agent.gpus import FakeProvider, ProcessUsage, fake_uuid
from tests.support.proctable import alive
from tests.support.agentkit import (TOKEN, WAIT, eventually, node, rpc_error, run,
                                    spawn_running, start_scheduler, worker)



# ---------------------------------------------------------------- registration


def test_registers_and_heartbeats_with_fake_gpus(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            await eventually(lambda: len(recorder.heartbeats) >= 2, "two heartbeats")
            info = recorder.registrations[0].node
            assert (info.node_id, info.address, info.agent_port, info.cpus) == (
                "node-a", "127.0.0.1", agent.port, 4.0)
            assert [(g.index, g.uuid, g.name) for g in info.gpus] == [
                (0, fake_uuid("node-a", 0), "Fake GPU"), (1, fake_uuid("node-a", 1), "Fake GPU")]
            assert all(g.memory_total_bytes == 80 * 1024**3 for g in info.gpus)
            beat = recorder.heartbeats[-1]
            assert beat.node_id == "node-a" and len(beat.gpus) == 2 and list(beat.running) == []
            assert agent.scheduler_id == "sched-test"
            remote = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=WAIT)
            assert remote.node_id == "node-a" and len(remote.gpus) == 2

    run(body())


def test_segments_of_dead_processes_are_removed_at_start(tmp_path):
    from podium.transport import shm

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{dead.pid}-stale")
    mine = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{os.getpid()}-alive")
    for path in (stale, mine):
        with open(path, "wb") as handle:
            handle.write(b"x")

    async def body():
        async with node(tmp_path):
            await eventually(lambda: not os.path.exists(stale), "the dead process's segment removed")
            assert os.path.exists(mine)  # its creator lives: a reader may still come

    try:
        run(body())
    finally:
        for path in (stale, mine):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_reregisters_when_asked_and_after_the_scheduler_comes_back(tmp_path):
    async def body():
        # A port nobody serves yet: the agent must keep retrying, not crash.
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        config = AgentConfig(scheduler=f"127.0.0.1:{port}", node_id="node-late", fake_gpus=1,
                             log_dir=str(tmp_path / "logs"), token=TOKEN)
        agent = await run_agent(config)
        try:
            await asyncio.sleep(0.3)
            assert agent.registrations == 0
            server, recorder, _ = await start_scheduler(port)
            await eventually(lambda: recorder.heartbeats, "first heartbeat after the scheduler came up")
            recorder.reregister_next = True
            await eventually(lambda: len(recorder.registrations) >= 2, "re-registration on request")
            await server.stop(None)
            await eventually(lambda: not agent.registered.is_set(), "the agent noticing the outage")
            server, recorder, _ = await start_scheduler(port)
            await eventually(lambda: recorder.registrations, "registration after the outage")
            await server.stop(None)
        finally:
            await agent.stop()

    run(body())


def test_agent_module_never_imports_torch():
    code = "import sys, podium.worker.agent.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- spawning


def test_spawn_reports_running_with_exact_env_and_log_files(tmp_path):
    async def body():
        env_file = tmp_path / "env.json"
        async with node(tmp_path) as (recorder, agent, stub):
            info = worker("w-1", FAKE_ENV_FILE=str(env_file), USER_VAR="x=1 y")
            response = await spawn_running(stub, recorder, info)
            spawned = response.workers[0]
            running = recorder.report("w-1", common_pb2.WORKER_RUNNING)
            assert spawned.worker_id == "w-1" and spawned.pid == running.pid > 0
            assert running.port > 0 and running.node_id == "node-a"
            env = json.loads(env_file.read_text())
            for key, value in info.env.items():
                assert env[key] == value, key
            assert env["PODIUM_TOKEN"] == TOKEN
            assert env["PODIUM_SCHEDULER"] == agent.config.scheduler
            assert env["PYTHONUNBUFFERED"] == "1"
            assert "PODIUM_TOKEN_FILE" not in env
            out = pathlib.Path(spawned.log_path)
            assert out == tmp_path / "logs" / "w-1.out"
            assert (tmp_path / "logs" / "w-1.err").exists()
            await eventually(lambda: "ready" in out.read_text(), "the worker's stdout in its log")
            assert "grp_w-1" in out.read_text().splitlines()[0]
            listed = await stub.ListWorkers(node_pb2.ListWorkersRequest(), timeout=WAIT)
            assert [(w.id, w.state, w.pid, w.port) for w in listed.workers] == [
                ("w-1", common_pb2.WORKER_RUNNING, running.pid, running.port)]
            await eventually(lambda: recorder.heartbeats and any(
                r.worker_id == "w-1" for r in recorder.heartbeats[-1].running),
                             "the worker in a heartbeat")
            # Spawning the same id again is harmless: same process.
            again = await stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(workers=[info]), timeout=WAIT)
            assert again.workers[0].pid == spawned.pid

    run(body())


def test_spawns_several_workers_in_one_request(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            infos = [worker(f"w-{i}", RANK=str(i), WORLD_SIZE="3") for i in range(3)]
            response = await spawn_running(stub, recorder, *infos)
            assert [w.worker_id for w in response.workers] == ["w-0", "w-1", "w-2"]
            assert len({w.pid for w in response.workers}) == 3

    run(body())


@pytest.mark.parametrize("mode, exit_code, reason_part, tail_part", [
    ("crash", 3, "exited before it was ready", "fatal: the fake worker was told to crash"),
    ("no_port", -1, "closed its ready pipe without a port", ""),
])
def test_worker_that_never_becomes_ready_fails(tmp_path, mode, exit_code, reason_part, tail_part):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            bad = worker("w-bad", FAKE_MODE=mode)
            response = await stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(workers=[bad]), timeout=WAIT)
            failed = await eventually(lambda: recorder.report("w-bad", common_pb2.WORKER_FAILED),
                                      "FAILED report")
            assert failed.exit.exit_code == exit_code
            assert reason_part in failed.exit.reason
            assert tail_part in failed.exit.stderr_tail
            assert not failed.exit.requested
            assert recorder.report("w-bad", common_pb2.WORKER_RUNNING) is None
            await eventually(lambda: not alive(response.workers[0].pid), "the broken worker gone")
            # The same id again starts a new process (a retry after a failure).
            bad.env["FAKE_MODE"] = "serve"
            await spawn_running(stub, recorder, bad)
            assert recorder.report("w-bad", common_pb2.WORKER_RUNNING).pid != response.workers[0].pid

    run(body())


def test_bad_worker_ids_are_rejected_before_anything_starts(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            for bad in (["../evil"], ["w-1", "w-1"], [""]):
                request = node_pb2.SpawnWorkersRequest(workers=[worker(i) for i in bad])
                error = await rpc_error(stub.SpawnWorkers(request, timeout=WAIT))
                assert isinstance(error, errors.InvalidArgumentError), bad
            assert agent.spawner.workers() == []

    run(body())


# ---------------------------------------------------------------- reaping and stopping


def test_sigkilled_worker_is_reported_with_signal_and_stderr_tail(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            await spawn_running(stub, recorder, worker("w-k", FAKE_LINES="60"))
            pid = recorder.report("w-k", common_pb2.WORKER_RUNNING).pid
            os.kill(pid, signal.SIGKILL)
            exited = await eventually(lambda: recorder.report("w-k", common_pb2.WORKER_EXITED),
                                      "EXITED report within 2 s", timeout=2.0)
            assert (exited.exit.exit_code, exited.exit.signal, exited.exit.reason) == (
                -1, 9, "killed by SIGKILL")
            assert not exited.exit.requested
            tail = exited.exit.stderr_tail.splitlines()
            assert tail == [f"err line {i}" for i in range(10, 60)]

    run(body())


def test_stop_workers_terminates_then_kills_after_grace(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            child_file = tmp_path / "child.pid"
            await spawn_running(stub, recorder, worker("w-polite"),
                                worker("w-stubborn", FAKE_MODE="ignore_term",
                                       FAKE_CHILD_PID_FILE=str(child_file)))
            child = int(child_file.read_text())
            response = await stub.StopWorkers(
                node_pb2.StopWorkersRequest(worker_ids=["w-polite", "w-stubborn"], grace_seconds=0.5),
                timeout=WAIT)
            assert response.stopped == 2
            polite = await eventually(lambda: recorder.report("w-polite", common_pb2.WORKER_EXITED),
                                      "polite EXITED")
            stubborn = await eventually(lambda: recorder.report("w-stubborn", common_pb2.WORKER_EXITED),
                                        "stubborn EXITED")
            assert (polite.exit.exit_code, polite.exit.signal, polite.exit.requested) == (0, 0, True)
            assert (stubborn.exit.exit_code, stubborn.exit.signal, stubborn.exit.requested) == (-1, 9, True)
            assert stubborn.exit.reason == "stopped by request"
            await eventually(lambda: not alive(child), "the stubborn worker's child gone")
            again = await stub.StopWorkers(node_pb2.StopWorkersRequest(worker_ids=["w-polite"]),
                                           timeout=WAIT)
            assert again.stopped == 0

    run(body())


def test_heartbeat_stop_list_stops_workers(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            await spawn_running(stub, recorder, worker("w-unwanted"))
            recorder.stop_next = ["w-unwanted", "w-never-heard-of"]
            exited = await eventually(lambda: recorder.report("w-unwanted", common_pb2.WORKER_EXITED),
                                      "EXITED after the heartbeat said stop")
            assert exited.exit.requested

    run(body())


def test_unknown_worker_ids_are_not_found(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            error = await rpc_error(stub.StopWorkers(
                node_pb2.StopWorkersRequest(worker_ids=["w-nope"]), timeout=WAIT))
            assert isinstance(error, errors.NotFoundError)
            stream = stub.TailLog(node_pb2.TailLogRequest(worker_id="w-nope"), timeout=WAIT)
            error = await rpc_error(stream.read())
            assert isinstance(error, errors.NotFoundError)

    run(body())


def test_agent_stop_leaves_no_process_behind(tmp_path):
    async def body():
        child_file = tmp_path / "child.pid"
        async with node(tmp_path) as (recorder, agent, stub):
            await spawn_running(stub, recorder, worker("w-a"),
                                worker("w-b", FAKE_MODE="ignore_term", FAKE_CHILD_PID_FILE=str(child_file)))
            pids = [r.pid for r in recorder.reports] + [int(child_file.read_text())]
            await agent.stop(grace=0.3)
            for wid in ("w-a", "w-b"):
                assert recorder.report(wid, common_pb2.WORKER_EXITED).exit.requested
            await eventually(lambda: not any(alive(pid) for pid in pids), "every process gone")

    run(body())


# ---------------------------------------------------------------- logs


def test_tail_log_last_lines_then_follow_until_exit(tmp_path, monkeypatch):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            await spawn_running(stub, recorder, worker("w-log", FAKE_LINES="5", FAKE_TICK="0.05"))
            await eventually(lambda: "ready" in (tmp_path / "logs" / "w-log.out").read_text(), "ready line")
            lines = [(line.stream, line.text) async for line in stub.TailLog(
                node_pb2.TailLogRequest(worker_id="w-log", last_lines=2), timeout=WAIT)]
            assert ("stderr", "err line 3") in lines and ("stderr", "err line 4") in lines
            assert len([s for s, _ in lines if s == "stdout"]) == 2
            async def whole_file():
                lines = [(line.stream, line.text) async for line in stub.TailLog(
                    node_pb2.TailLogRequest(worker_id="w-log"), timeout=WAIT)]
                return ([t for s, t in lines if s == "stdout"], [t for s, t in lines if s == "stderr"])

            out, err = await whole_file()
            assert out[:6] == [f"out line {i}" for i in range(5)] + ["ready"]
            assert err == [f"err line {i}" for i in range(5)]
            # Reading in tiny chunks cuts lines anywhere; they still come out whole.
            from podium.worker.agent import logtail

            monkeypatch.setattr(logtail.LogFollower, "CHUNK", 7)
            chunked_out, chunked_err = await whole_file()
            monkeypatch.undo()
            assert chunked_err == err
            assert chunked_out[:len(out)] == out  # ticks keep coming meanwhile

            stream = stub.TailLog(node_pb2.TailLogRequest(worker_id="w-log", last_lines=1, follow=True),
                                  timeout=WAIT)
            seen = []
            async for line in stream:
                seen.append(line.text)
                if len([t for t in seen if t.startswith("tick")]) >= 5:
                    break
            assert len(set(seen)) == len(seen)  # no line twice
            stream.cancel()
            # A follower ends by itself when the worker exits.
            follower = stub.TailLog(node_pb2.TailLogRequest(worker_id="w-log", last_lines=1, follow=True),
                                    timeout=WAIT)
            first = await follower.read()
            assert first.worker_id == "w-log"
            await stub.StopWorkers(node_pb2.StopWorkersRequest(worker_ids=["w-log"], grace_seconds=1),
                                   timeout=WAIT)
            async for _ in follower:
                pass
            assert await follower.code() == grpc.StatusCode.OK

    run(body())


# ---------------------------------------------------------------- ports


def can_bind(port: int) -> bool:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def test_reserve_port_holds_until_spawn_or_expiry(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            held = (await stub.ReservePort(node_pb2.ReservePortRequest(), timeout=WAIT)).port
            assert held > 0 and not can_bind(held)
            # outside the kernel's ephemeral range: no outgoing connection can take it (#51)
            low, high = ephemeral_range()
            assert not low <= held <= high and agent.ports.range[0] <= held <= agent.ports.range[1]
            await spawn_running(stub, recorder, worker("w-master", MASTER_PORT=str(held)),
                                reserved_port=held)
            assert can_bind(held) and agent.ports.held() == []

            brief = (await stub.ReservePort(node_pb2.ReservePortRequest(hold_seconds=0.2), timeout=WAIT)).port
            assert not can_bind(brief)
            await eventually(lambda: can_bind(brief), "the hold to expire")

            error = await rpc_error(stub.ReservePort(node_pb2.ReservePortRequest(hold_seconds=-1),
                                                     timeout=WAIT))
            assert isinstance(error, errors.InvalidArgumentError)

    run(body())


def socket_owners(port: int) -> list[int]:
    """Pids of the processes holding the socket that listens on ``port`` (by inode)."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as table:
            for line in table.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                owners.append(int(pid))
    return owners


def test_the_master_inherits_the_reserved_port_and_no_one_else_holds_it(tmp_path):
    """MASTER_PORT is never free between the agent's reservation and rank 0 (issue 51): the
    master worker inherits the listening socket (PODIUM_MASTER_LISTEN_FD), the agent keeps no
    copy, and the port is free again only once that worker is gone."""
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            held = (await stub.ReservePort(node_pb2.ReservePortRequest(), timeout=WAIT)).port
            master, other = worker("w-master", MASTER_PORT=str(held)), worker("w-other", MASTER_PORT=str(held))
            reply = await stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(
                workers=[master, other], reserved_port=held, master_worker_id="w-master"), timeout=WAIT)
            pids = {w.worker_id: w.pid for w in reply.workers}
            for info in (master, other):
                await eventually(lambda: recorder.report(info.id, common_pb2.WORKER_RUNNING), f"{info.id} RUNNING")
            assert agent.ports.held() == [] and not can_bind(held)
            assert socket_owners(held) == [pids["w-master"]]
            await stub.StopWorkers(node_pb2.StopWorkersRequest(worker_ids=["w-master"]), timeout=WAIT)
            await eventually(lambda: can_bind(held), "the port to be free once its master is gone")

            # a master id that is not in the request is refused, and nothing starts
            again = (await stub.ReservePort(node_pb2.ReservePortRequest(), timeout=WAIT)).port
            error = await rpc_error(stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(
                workers=[worker("w-third")], reserved_port=again, master_worker_id="w-nobody"), timeout=WAIT))
            assert isinstance(error, errors.InvalidArgumentError) and "w-nobody" in str(error)
            assert agent.ports.held() == [again]

    run(body())


# ---------------------------------------------------------------- failure edges


def test_unstartable_worker_command_fails_with_the_reason_in_its_stderr(tmp_path):
    async def body():
        async with node(tmp_path, worker_command=[str(tmp_path / "no-such-worker")]) as (recorder, agent, stub):
            await stub.SpawnWorkers(node_pb2.SpawnWorkersRequest(workers=[worker("w-x")]), timeout=WAIT)
            failed = await eventually(lambda: recorder.report("w-x", common_pb2.WORKER_FAILED), "FAILED")
            assert "cannot start" in failed.exit.stderr_tail
            assert "no-such-worker" in failed.exit.stderr_tail
            assert failed.exit.exit_code == 127 and "exited before it was ready" in failed.exit.reason

    run(body())


def test_a_stopping_agent_refuses_new_workers(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            await agent.spawner.stop_all()
            with pytest.raises(errors.UnavailableError):
                await agent.spawner.spawn([worker("w-late")])
            assert agent.spawner.workers() == []

    run(body())


@pytest.mark.parametrize("flags, message", [
    (["--fake-gpu-memory", "lots"], "bad size"),
    (["--tls-cert", "only-one.pem"], "go together"),
    (["--label", "no-equals-sign"], "KEY=VALUE"),
    (["--stop-grace", "-1"], "--stop-grace"),
    (["--host", "0.0.0.0"], "--advertise-address"),
])
def test_cli_rejects_bad_flags_with_status_2(flags, message, capsys, monkeypatch):
    from podium.worker.agent import service as agent

    monkeypatch.setenv("PODIUM_TOKEN", TOKEN)
    # main() installs uvloop as the process-wide policy; keep this test process as it was.
    monkeypatch.setattr(rpc, "use_uvloop", lambda: None)
    assert agent.main(["--scheduler", "127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert "podium node:" in err and message in err


class ProvidedGpus(FakeProvider):
    """Fake GPUs whose process list the test sets (stands in for NVML)."""

    def __init__(self) -> None:
        super().__init__(2, node_id="node-a")
        self.usage: list[ProcessUsage] = []

    def processes(self) -> list[ProcessUsage]:
        return list(self.usage)


def test_heartbeat_attributes_gpu_memory_to_workers_by_pid_and_process_group(tmp_path):
    async def body():
        provider = ProvidedGpus()
        child_file = tmp_path / "child.pid"
        async with node(tmp_path, provider=provider, token=TOKEN) as (recorder, agent, stub):
            await spawn_running(stub, recorder, worker("w-gpu", FAKE_CHILD_PID_FILE=str(child_file)))
            pid = recorder.report("w-gpu", common_pb2.WORKER_RUNNING).pid
            child = int(child_file.read_text())
            uuid0 = fake_uuid("node-a", 0)
            provider.usage = [ProcessUsage(pid, uuid0, 1 << 30), ProcessUsage(child, uuid0, 2 << 20),
                              ProcessUsage(os.getpid(), uuid0, 5)]
            beat = await eventually(
                lambda: next((b for b in reversed(recorder.heartbeats) if b.processes), None),
                "a heartbeat with processes")
            assert [(p.pid, p.gpu_uuid, p.used_bytes, p.worker_id) for p in beat.processes] == [
                (pid, uuid0, 1 << 30, "w-gpu"), (child, uuid0, 2 << 20, "w-gpu"), (os.getpid(), uuid0, 5, "")]

    run(body())


def test_advertise_address_is_what_registers_and_what_workers_get(tmp_path):
    async def body():
        env_file = tmp_path / "env.json"
        async with node(tmp_path, host="0.0.0.0", advertise_address="127.0.0.1",
                        node_id="") as (recorder, agent, stub):
            await eventually(lambda: recorder.registrations, "registration")
            info = recorder.registrations[0].node
            assert info.address == "127.0.0.1" and info.node_id.endswith("-127.0.0.1")
            bare = common_pb2.WorkerInfo(id="w-bare", env={"FAKE_ENV_FILE": str(env_file)})
            await spawn_running(stub, recorder, bare)
            assert json.loads(env_file.read_text())["PODIUM_NODE_ADDRESS"] == "127.0.0.1"

    run(body())


def test_a_taken_port_fails_the_start_cleanly(tmp_path):
    async def body():
        async with node(tmp_path) as (recorder, agent, stub):
            config = AgentConfig(scheduler=agent.config.scheduler, port=agent.port, node_id="node-b",
                                 fake_gpus=0, log_dir=str(tmp_path / "logs-b"), token=TOKEN)
            with pytest.raises(errors.UnavailableError):
                await run_agent(config)
            # The first agent is unaffected.
            info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=WAIT)
            assert info.node_id == "node-a"

    run(body())
