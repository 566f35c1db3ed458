"""MASTER_PORT cannot be stolen (issue 51): port thieves hold every port of the kernel's
ephemeral range while a group starts and forms its gloo group (tests.support.portthief says
how). Before, the agent reserved MASTER_PORT in that range and released it just before the
worker started; any outgoing connection on a busy host could take it in between: rank 0 got
EADDRINUSE and the other ranks waited 30 minutes for its store."""

from __future__ import annotations

import pytest

from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register
from podium.worker.agent.ports import ephemeral_range
from tests.support.clusters import TWO_NODES, controller_cluster
from tests.support.proctable import listeners
from tests.support import portthief

torch = pytest.importorskip("torch")


class Gloo(Worker):
    """Forms a gloo group from the env Podium sets and all-reduces once."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce(self):
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()


def test_a_port_thief_cannot_take_master_port(tmp_path):
    low, high = ephemeral_range()
    with controller_cluster("two_nodes", tmp_path, gpus_per_node=2):
        thieves = portthief.start(low, high)
        try:
            wg = WorkerGroup(ResourcePool([2, 2], use_gpu=False), ClassWithInitArgs(Gloo))
            try:
                assert wg.allreduce() == [10.0] * 4
                assert not low <= int(wg.master_port) <= high
            finally:
                wg.shutdown()
        finally:
            portthief.stop(thieves)


class Listens(Worker):
    """Forms a gloo group with plain ``env://`` and keeps it, so the test can look at the
    MASTER_PORT listener while the group lives."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def form(self):
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def leave(self):
        import torch.distributed as dist
        dist.destroy_process_group()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tcp_group_in_a_child(self):
        """A child process forms its own group on ``tcp://`` as vLLM's workers do: its rank 0
        hosts that store, so nothing of the parent's MASTER_PORT store may leak to it."""
        import subprocess
        import sys
        child = ("import datetime, os, socket, torch, torch.distributed as dist\n"
                 "assert 'PODIUM_MASTER_LISTEN_FD' not in os.environ, os.environ\n"
                 "assert 'TORCHELASTIC_USE_AGENT_STORE' not in os.environ\n"
                 "s = socket.socket(); s.bind((os.environ['MASTER_ADDR'], 0)); port = s.getsockname()[1]; s.close()\n"
                 "dist.init_process_group('gloo', init_method=f\"tcp://{os.environ['MASTER_ADDR']}:{port}\",\n"
                 "                        rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))\n"
                 "t = torch.ones(1); dist.all_reduce(t); dist.destroy_process_group(); print(t.item())\n")
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout.strip(), done.stderr[-2000:]


def free_odd_port(addresses) -> int:
    """An odd port of the default rendezvous range free on every one of ``addresses``."""
    import random
    import socket
    for port in random.sample(range(20001, 32767, 2), 200):
        socks = []
        try:
            for address in addresses:
                sock = socket.socket()
                socks.append(sock)
                sock.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free odd port in 20001-32767")


def test_master_port_listens_on_the_node_address_only(tmp_path, monkeypatch):
    """The group's first store is served on the socket the agent bound to the node address:
    user code's plain ``env://`` init works, the listener is that address alone, and a thief
    holding the same port on another address of the host changes nothing (torch's own store
    binds every address, so it failed with EADDRINUSE against the thief)."""
    from podium.worker.agent.ports import RANGE_ENV
    port = free_odd_port((*TWO_NODES, portthief.THIEF_ADDRESS, "127.0.0.1"))
    monkeypatch.setenv(RANGE_ENV, f"{port}-{port}")  # the agents' only rendezvous port
    with controller_cluster("two_nodes", tmp_path, gpus_per_node=2):
        thieves = portthief.start(port, port)
        try:
            wg = WorkerGroup(ResourcePool([2, 2], use_gpu=False), ClassWithInitArgs(Listens))
            try:
                assert int(wg.master_port) == port and wg.master_address == TWO_NODES[0]
                assert wg.form() == [10.0] * 4
                assert listeners(port) == [TWO_NODES[0]]
                import socket
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", port), timeout=10).close()
                code, out, err = wg.tcp_group_in_a_child()[0]
                assert (code, out) == (0, "1.0"), err
                wg.leave()
                assert wg.form() == [10.0] * 4  # destroyed and formed again on the same store
                wg.leave()
            finally:
                wg.shutdown()
        finally:
            portthief.stop(thieves)
