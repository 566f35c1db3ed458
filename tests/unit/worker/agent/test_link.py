"""SchedulerLink alone, driven by scripted register and heartbeat calls (no sockets): it
registers, heartbeats at the interval the scheduler gives, registers again when asked or
when a beat fails, retries an unreachable scheduler (logging each outage once), hands on
the workers the scheduler does not want, and stops when told."""

from __future__ import annotations

import asyncio
import logging
import time

from podium import errors
from podium.v1 import scheduler_pb2
from podium.worker.agent.link import SchedulerLink


class Script:
    """Plays the scheduler: answers (or raises) from queued outcomes, and records the calls."""

    def __init__(self, registers, beats):
        self.registers = list(registers)
        self.beats = list(beats)
        self.calls: list[str] = []
        self.unwanted: list[list[str]] = []
        self.done = asyncio.Event()

    async def register(self):
        self.calls.append("register")
        return self._next(self.registers)

    async def beat(self):
        self.calls.append("beat")
        return self._next(self.beats)

    def _next(self, queue):
        if not queue or (len(self.registers) == 0 and len(self.beats) == 0):
            self.done.set()
        if not queue:
            raise errors.UnavailableError("script over")
        outcome = queue.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _registered(interval=0.01, scheduler_id="sched-1"):
    return scheduler_pb2.RegisterNodeResponse(heartbeat_interval_seconds=interval,
                                              scheduler_id=scheduler_id)


async def _run(script: Script, **kw) -> SchedulerLink:
    link = SchedulerLink("n1", register=script.register, beat=script.beat,
                         unwanted=script.unwanted.append, **kw)
    task = asyncio.get_running_loop().create_task(link.run())
    await asyncio.wait_for(script.done.wait(), 20)
    link.stop.set()
    await asyncio.wait_for(task, 20)
    return link


def test_register_beat_and_register_again_when_asked(arun):
    ok = scheduler_pb2.HeartbeatResponse()
    script = Script(
        registers=[_registered(scheduler_id="sched-1"), _registered(scheduler_id="sched-2")],
        beats=[ok, scheduler_pb2.HeartbeatResponse(stop_worker_ids=["w-1", "w-2"]),
               scheduler_pb2.HeartbeatResponse(reregister=True), ok])
    link = arun(_run(script))
    assert script.calls[:6] == ["register", "beat", "beat", "beat", "register", "beat"]
    assert script.unwanted == [["w-1", "w-2"]]
    assert link.registrations == 2 and link.scheduler_id == "sched-2"
    assert link.heartbeats >= 4


def test_a_failed_beat_clears_registered_and_registers_again(arun):
    seen = []

    async def scenario():
        script = Script(registers=[_registered(), _registered()],
                        beats=[errors.DeadlineExceededError("slow"), scheduler_pb2.HeartbeatResponse()])

        async def beat():  # what the flag says while each beat is sent
            seen.append(link.registered.is_set())
            return await script.beat()
        link = SchedulerLink("n1", register=script.register, beat=beat,
                             unwanted=script.unwanted.append)
        task = asyncio.get_running_loop().create_task(link.run())
        await asyncio.wait_for(script.done.wait(), 20)
        link.stop.set()
        await task
        return script, link

    script, link = arun(scenario())
    assert script.calls[:4] == ["register", "beat", "register", "beat"]
    assert seen[:2] == [True, True] and link.registrations == 2 and link.heartbeats >= 1


def test_an_unreachable_scheduler_is_retried_and_each_outage_logged_once(arun, caplog):
    down = errors.UnavailableError("connection refused")
    script = Script(registers=[down, down, down, _registered()], beats=[scheduler_pb2.HeartbeatResponse()])
    with caplog.at_level(logging.WARNING, logger="podium.worker.agent.link"):
        link = arun(_run(script, jitter=lambda: 0.5))
    assert script.calls[:5] == ["register"] * 4 + ["beat"]
    assert link.registrations == 1
    # Three refused tries, one outage, one line (the script's end is a second outage).
    outages = [r for r in caplog.records if "connection refused" in r.getMessage()]
    assert len(outages) == 1 and outages[0].levelno == logging.WARNING


def test_a_refusal_is_logged_as_an_error_and_still_retried(arun, caplog):
    script = Script(registers=[errors.AuthenticationError("bad token"), _registered()],
                    beats=[scheduler_pb2.HeartbeatResponse()])
    with caplog.at_level(logging.WARNING, logger="podium.worker.agent.link"):
        link = arun(_run(script))
    assert link.registrations == 1
    assert [r.levelno for r in caplog.records if "bad token" in r.getMessage()] == [logging.ERROR]


def test_a_stopped_link_returns_without_registering(arun):
    async def scenario():
        script = Script(registers=[_registered()], beats=[])
        link = SchedulerLink("n1", register=script.register, beat=script.beat,
                             unwanted=script.unwanted.append)
        link.stop.set()
        await asyncio.wait_for(link.run(), 5)
        return script, link
    script, link = arun(scenario())
    assert script.calls == [] and link.registrations == 0 and not link.registered.is_set()


# -- fencing ---------------------------------------------------------------------------------

LEASE, INTERVAL = 0.4, 0.02


async def _fenced_after(beat_outcome, register_outcome, run_for: float) -> tuple[SchedulerLink, list[int]]:
    """Register once (lease LEASE), then every beat and registration meets the given outcome
    (an exception to raise, or "hang": a call that never returns); one entry per fence."""
    fenced: list[int] = []
    registered = [False]

    async def outcome(what):
        if what == "hang":
            await asyncio.Event().wait()
        raise what

    async def register():
        if not registered[0]:
            registered[0] = True
            return scheduler_pb2.RegisterNodeResponse(heartbeat_interval_seconds=INTERVAL, lease_seconds=LEASE)
        return await outcome(register_outcome)

    async def beat():
        return await outcome(beat_outcome)

    loop = asyncio.get_running_loop()
    link = SchedulerLink("n1", register=register, beat=beat, unwanted=lambda ids: None,
                         fence=lambda: fenced.append(1) or 3)
    task = loop.create_task(link.run())
    await asyncio.sleep(run_for)
    link.stop.set()
    task.cancel()  # a hanging call does not see the stop
    await asyncio.gather(task, return_exceptions=True)
    return link, fenced


def test_a_node_cut_off_fences_itself_before_its_lease_can_run_out(arun):
    # A partition: the heartbeat never returns.
    link, fenced = arun(_fenced_after("hang", "hang", run_for=3 * LEASE))
    assert link.fences == 1 and len(fenced) == 1  # once, not again for the same silence


def test_timeouts_fence_too(arun):
    link, fenced = arun(_fenced_after(errors.DeadlineExceededError("heartbeat timed out"),
                                      errors.DeadlineExceededError("register timed out"), run_for=3 * LEASE))
    assert link.fences == 1 and len(fenced) == 1


def test_a_scheduler_that_refuses_connections_is_down_and_fences_nothing(arun):
    # SIGKILLed, restarting: it restarts every lease when it is back, so no rank can be
    # placed twice meanwhile and the node keeps its workers.
    refused = errors.UnavailableError("scheduler 10.0.0.1:50051 Heartbeat: failed to connect to all addresses; "
                                      "last error: UNKNOWN: ipv4:10.0.0.1:50051: Connection refused")
    link, fenced = arun(_fenced_after(refused, refused, run_for=3 * LEASE))
    assert link.fences == 0 and fenced == []


def test_without_a_lease_from_the_scheduler_nothing_fences(arun):
    async def scenario():
        fenced = []
        link = SchedulerLink("n1", register=lambda: asyncio.sleep(0, _registered(INTERVAL)),
                             beat=lambda: asyncio.Event().wait(), unwanted=lambda ids: None,
                             fence=lambda: fenced.append(1) or 0)
        task = asyncio.get_running_loop().create_task(link.run())
        await asyncio.sleep(3 * LEASE)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return fenced
    assert arun(scenario()) == []


def test_each_renewal_tells_the_new_fence_deadline(arun):
    async def scenario():
        told: list[float] = []
        script = Script([scheduler_pb2.RegisterNodeResponse(heartbeat_interval_seconds=INTERVAL,
                                                            lease_seconds=LEASE)],
                        [scheduler_pb2.HeartbeatResponse()] * 3)
        link = await _run(script, renewed=told.append)
        return link, told
    link, told = arun(scenario())
    assert len(told) == 4 and told == sorted(told)  # the registration and three heartbeats
    assert link.fence_deadline() == told[-1]


def test_a_readopting_agent_fences_by_the_inherited_deadline_when_it_cannot_register(arun):
    """An agent that re-adopted workers inherits its predecessor's fence deadline: if the
    scheduler cannot be reached (a timeout, not a refusal) it fences by then."""
    async def scenario(outcome):
        fenced = []

        async def register():
            if outcome == "hang":
                await asyncio.Event().wait()
            raise outcome

        link = SchedulerLink("n1", register=register, beat=register, unwanted=lambda ids: None,
                             fence=lambda: fenced.append(1) or 2)
        link.inherit_fence(time.monotonic() + LEASE / 2)
        task = asyncio.get_running_loop().create_task(link.run())
        await asyncio.sleep(2 * LEASE)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return fenced
    assert arun(scenario("hang")) == [1]
    refused = errors.UnavailableError("failed to connect to all addresses; Connection refused")
    assert arun(scenario(refused)) == []  # a scheduler known to be down restarts every lease
