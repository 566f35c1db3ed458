"""torch's store of MASTER_PORT served by rank 0 on the socket its agent bound
(podium.worker.masterstore, issue 51): real processes, real torch, plain ``env://``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from podium.worker import masterstore
from tests.support.proctable import listeners
from tests.support.waiting import REPO

pytest.importorskip("torch")

#: One rank: takes the socket before torch is imported (the import hook's path), forms the group
#: three times (destroyed in between, as a group's calls do), and rank 0 also hosts a tcp://
#: store on another port (what vLLM's workers do) and reports MASTER_PORT's listeners.
RANK = r"""
import datetime, json, logging, os, socket, sys, time
logging.basicConfig(level=logging.INFO)
from podium.worker import masterstore
before = "torch" in sys.modules
masterstore.take_listen_fd()
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
out = {"torch_before": before, "sums": []}
for _ in range(3):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sums"].append(t.item())
    if rank == 0 and not out.get("tcp"):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); other = s.getsockname()[1]; s.close()
        store, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{other}?rank=0&world_size=1",
                                           timeout=datetime.timedelta(seconds=60)))
        store.set("k", "v")
        out["tcp"] = store.get("k").decode()
        out["env_seen"] = sorted(k for k in os.environ if k in ("PODIUM_MASTER_LISTEN_FD", "TORCHELASTIC_USE_AGENT_STORE"))
        out["held"] = masterstore.held_ports()
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        time.sleep(1)  # the next call starts once every rank has left (as WorkerGroup calls do)
print(json.dumps(out))
"""


def test_rank_0_serves_env_init_on_the_inherited_socket_only(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop(masterstore.LISTEN_FD_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", RANK], pass_fds=(sock.fileno(),), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(env, RANK="0", **{masterstore.LISTEN_FD_ENV: str(sock.fileno())}))]
    sock.close()  # rank 0 holds it now: the port is never free
    assert listeners(port) == ["127.0.0.1"]
    procs += [subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=dict(env, RANK=str(rank))) for rank in (1, 2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["sums"] for r in results] == [[6.0] * 3] * 3
    zero = results[0]
    assert zero["torch_before"] is False  # the handlers were wrapped by the import hook
    assert zero["tcp"] == "v" and zero["env_seen"] == [] and zero["held"] == [port]
    # rank 0 served each of the three groups on the held socket (torch's own bind of the port
    # would have failed: it is held)
    assert outs[0][1].count(f"serves torch's store of MASTER_PORT {port} on 127.0.0.1 only") == 3
    assert listeners(port) == []  # gone with rank 0


def test_a_socket_of_another_port_is_closed_and_nothing_is_held():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    fd = sock.detach()
    env = {masterstore.LISTEN_FD_ENV: str(fd), "MASTER_PORT": "1"}
    masterstore.take_listen_fd(env)
    assert masterstore.LISTEN_FD_ENV not in env and masterstore.held_ports() == []
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    env = {masterstore.LISTEN_FD_ENV: "not a number", "MASTER_PORT": "1"}
    masterstore.take_listen_fd(env)  # a warning, nothing else
    assert masterstore.held_ports() == []


def test_a_held_port_is_handed_to_podiums_own_store():
    """Code that serves its own store on MASTER_PORT in rank 0 (the GRPO recipe's authenticated
    one) takes the held socket instead of binding the port, which rank 0 already holds."""
    from podium.transport.authstore import StoreServer, connect_store, new_key
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    masterstore.hold(sock)
    try:
        with pytest.raises(OSError):  # what binding it again gives
            StoreServer("127.0.0.1", new_key(), port)
        key = new_key()
        server = StoreServer("127.0.0.1", key, port, listener=masterstore.take(port))
        assert port not in masterstore.held_ports() and masterstore.take(port) is None
        store = connect_store("127.0.0.1", port, key, 30)
        store.set("k", b"v")
        assert store.get("k") == b"v" and listeners(port) == ["127.0.0.1"]
        server.close()
    finally:
        masterstore.release(port)
