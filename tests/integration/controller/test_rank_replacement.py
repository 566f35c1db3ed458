"""Issue 51 items 2 and 5: a dead rank replaced from a warm standby, and training goes on.

Four ranks train a small model with gloo all-reduce, step by step. One rank is SIGKILLed
(then, in the second test, SIGSTOPped: found by liveness) in the middle of a step; the step
fails with WorkerDiedError (UnresponsiveError for the stopped one); the group, with
``on_rank_death="replace"``, replaces it from its standby before the next call; every rank
re-forms gloo in its ``@on_rendezvous`` hook (rank 0 broadcasts the parameters to the
newcomer); the lost step is replayed. The parameters after N steps equal those of the same
group's undisturbed run, bit for bit, and the replaced process is fenced: dead, even after
SIGCONT.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from podium import errors
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.worker import Dispatch, register
from tests.support.clusters import controller_cluster
from tests.support.proctable import alive

torch = pytest.importorskip("torch")

from tests.support.glootrainer import GlooTrainer  # noqa: E402  (it imports torch)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

#: The liveness bound these tests run with (the default is 10 s).
SILENCE = 3.0
STEPS = 6
#: The step the victim dies in.
BROKEN_STEP = 3
VICTIM = 2


class Trainer(GlooTrainer):
    """The shared gloo trainer, and each rank's view of itself."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def identity(self):
        return (self.rank, int(os.environ["RANK"]), int(os.environ["MASTER_PORT"]), os.getpid(), self.hooks,
                self.stores)


class StoreTrainer(Trainer):
    """Trainer whose ranks re-form gloo on the Podium store of each new rendezvous."""

    podium_store = True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with controller_cluster("embedded", tmp_path_factory.mktemp("embedded")):
        liveness = get_runtime().deathwatch.liveness
        old, liveness.silence = liveness.silence, SILENCE
        try:
            yield
        finally:
            liveness.silence = old


def undisturbed(wg):
    wg.reset()
    for s in range(STEPS):
        wg.step(s)
    return wg.params()


def disturbed(wg, how):
    """STEPS steps with the victim killed or stopped in BROKEN_STEP, replayed after."""
    wg.reset()
    for s in range(BROKEN_STEP):
        wg.step(s)
    victim_pid = wg.workers[VICTIM].pid
    standby = wg.standby_workers[0]
    rt = get_runtime()
    listed = rt.run(rt.scheduler.get_workers(group=f"{wg.name_prefix}.standby"))
    assert [w.id for w in listed] == [standby.worker_id]  # what `podium status` and the dashboard list
    port = wg.master_port

    def strike():
        time.sleep(1.0)  # the ranks are inside the step (the victim in its stall)
        os.kill(victim_pid, how)

    threading.Thread(target=strike, daemon=True).start()
    expected = errors.WorkerDiedError if how == signal.SIGKILL else errors.UnresponsiveError
    with pytest.raises(expected) as err:
        wg.step(BROKEN_STEP, stall_rank=VICTIM)
    assert err.value.rank == VICTIM
    for s in range(BROKEN_STEP, STEPS):  # the first call replaces the rank, then replays the step
        wg.step(s)
    # The standby holds rank VICTIM; a new rendezvous (version, port) reached every rank.
    assert wg.workers[VICTIM].worker_id == standby.worker_id and not wg.standby_workers
    assert wg.master_port != port and wg.rendezvous_version >= 1
    # The scheduler's record followed the handover: the standby is in the group, with its rank.
    group = rt.run(rt.scheduler.get_workers(group=wg.name_prefix))
    assert [(w.spec.rank, w.spec.world_size) for w in group] == [(r, 4) for r in range(4)]
    assert group[VICTIM].id == standby.worker_id
    assert rt.run(rt.scheduler.get_workers(group=f"{wg.name_prefix}.standby")) == []
    ids = wg.identity()
    assert [i[0] for i in ids] == [i[1] for i in ids] == [0, 1, 2, 3]
    assert {i[2] for i in ids} == {int(wg.master_port)}
    assert all(i[4][-1] == wg.rendezvous_version for i in ids)
    if ids[0][5]:  # re-formed on the Podium store: rank 0 serves it on its node address only
        [(version, addr, store_port)] = {i[5][-1] for i in ids}
        assert version == wg.rendezvous_version and addr == wg.workers[0].node_address and store_port > 0
        other = "127.0.0.3" if addr == "127.0.0.2" else "127.0.0.2"  # another address of this host
        with pytest.raises(ConnectionRefusedError):  # torch's TCPStore (every interface) would accept
            socket.create_connection((other, store_port), timeout=5).close()
        socket.create_connection((addr, store_port), timeout=5).close()
    # Fenced: the replaced process is gone, and a SIGCONT brings nothing back.
    with_cont = how == signal.SIGSTOP
    if with_cont:
        try:
            os.kill(victim_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not alive(victim_pid)
    return wg.params()


@pytest.mark.parametrize("how,cls", [(signal.SIGKILL, StoreTrainer), (signal.SIGSTOP, Trainer)],
                         ids=["sigkill-podium-store", "sigstop-env"])
def test_a_dead_rank_is_replaced_and_training_matches_bit_for_bit(cluster, how, cls):
    pool = ResourcePool([4], use_gpu=False)
    wg = WorkerGroup(pool, ClassWithInitArgs(cls), standby=1, on_rank_death="replace")
    try:
        assert wg.form() == [0, 1, 2, 3]
        reference = undisturbed(wg)
        after = disturbed(wg, how)
        assert all(i[5] for i in wg.identity()) == (cls is StoreTrainer)  # which store the ranks re-formed on
        for ref_rank, got_rank in zip(reference, after):
            for a, b in zip(ref_rank, got_rank):
                assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(after[0], after[VICTIM]))
    finally:
        wg.shutdown()


def test_replace_rank_without_a_standby_starts_a_fresh_worker(cluster):
    pool = ResourcePool([2], use_gpu=False)
    wg = WorkerGroup(pool, ClassWithInitArgs(Trainer))
    try:
        wg.form()
        old = wg.workers[1].pid
        handle = wg.replace_rank(1)
        assert handle.rank == 1 and handle.pid != old and not alive(old)
        assert [i[0] for i in wg.identity()] == [0, 1]
        rt = get_runtime()
        group = rt.run(rt.scheduler.get_workers(group=wg.name_prefix))
        assert [(w.id, w.spec.rank) for w in group] == [(wg.workers[0].worker_id, 0), (handle.worker_id, 1)]
        wg.reset()  # every rank from the same seed: the step runs on the new membership
        assert wg.step(0) == [0, 0]
        with pytest.raises(errors.InvalidArgumentError, match="ranks 0..1"):
            wg.replace_rank(2)
    finally:
        wg.shutdown()


def test_replace_worker_hands_the_rank_to_the_chosen_standby(cluster):
    """verl's ``replace_worker(rank, new_worker_handle)``: the handle is one of the standbys."""
    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Trainer), standby=2)
    try:
        wg.form()
        first, second = wg.standby_workers
        before = [w.worker_id for w in wg.workers]
        with pytest.raises(errors.InvalidArgumentError, match="one of the group's standbys"):
            wg.replace_worker(1, wg.workers[0])  # a rank is no standby: refused, nothing changed
        assert [w.worker_id for w in wg.workers] == before and alive(wg.workers[1].pid)
        assert wg.rendezvous_version == 0 and len(wg.standby_workers) == 2
        handle = wg.replace_worker(1, second)
        assert handle.worker_id == second.worker_id and wg.workers[1].worker_id == second.worker_id
        assert [w.worker_id for w in wg.standby_workers] == [first.worker_id]
        assert wg.replace_worker(0).worker_id == first.worker_id  # None: the next standby
        assert [i[0] for i in wg.identity()] == [0, 1] and wg.rendezvous_version == 2
    finally:
        wg.shutdown()


class Squatted(Trainer):
    """Rank 0's rendezvous fails: something else listens on MASTER_PORT (EADDRINUSE); the
    other ranks wait in it with torch's default 30-minute timeout."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def form_squatted(self):
        import socket

        import torch.distributed as dist

        from podium.worker import masterstore
        if self.rank == 0:
            # Rank 0 holds MASTER_PORT from its agent and would serve the store on it: let go
            # of it, so that the squatter can take it and torch's own bind fails.
            port = int(os.environ["MASTER_PORT"])
            assert masterstore.release(port)
            self._squatter = socket.socket()
            self._squatter.bind(("", port))
            self._squatter.listen(1)
        dist.init_process_group("gloo")
        return self.rank


@pytest.mark.parametrize("policy", ["raise", "replace"])
def test_a_failed_rendezvous_breaks_the_group_at_once(cluster, policy):
    wg = WorkerGroup(ResourcePool([3], use_gpu=False), ClassWithInitArgs(Squatted), on_rank_death=policy)
    try:
        with pytest.raises(errors.RemoteError, match="EADDRINUSE") as err:
            wg.form_squatted()
        assert err.value.rank == 0 and err.value.remote_type == "torch.distributed.DistNetworkError"
        if policy == "raise":
            # The next call fails at once with the reason, not behind ranks stuck for 30 minutes.
            with pytest.raises(errors.FailedPreconditionError, match="rank 0's rendezvous failed"):
                wg.identity()
            return
        # Every rank of the failed rendezvous (rank 0, and ranks 1 and 2 that waited in it) is
        # replaced by a fresh worker, and they take the new rendezvous.
        pids = [w.pid for w in wg.workers]
        ids = wg.identity()
        assert [i[0] for i in ids] == [0, 1, 2] and wg.rendezvous_version == 1
        assert not {i[3] for i in ids} & set(pids) and not any(alive(p) for p in pids)
        wg.reset()
        assert wg.step(0) == [0, 0, 0]
    finally:
        wg.shutdown()


def test_standbys_without_spare_capacity_are_infeasible_at_once(cluster):
    with pytest.raises(errors.InfeasibleError, match="standby=64") as err:
        WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Trainer), name_prefix="spare",
                    standby=64)
    assert err.value.node_reasons  # each node's reason
    rt = get_runtime()
    assert rt.run(rt.scheduler.get_workers(group="spare")) == []  # refused before any worker started


def test_bad_policies_are_refused(cluster):
    pool = ResourcePool([1], use_gpu=False)
    with pytest.raises(errors.InvalidArgumentError, match="standby must be an int"):
        WorkerGroup(pool, ClassWithInitArgs(Trainer), standby=-1)
    with pytest.raises(errors.InvalidArgumentError, match="on_rank_death must be one of"):
        WorkerGroup(pool, ClassWithInitArgs(Trainer), on_rank_death="restart")
