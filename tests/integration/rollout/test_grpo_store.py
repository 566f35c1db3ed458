"""The GRPO actor's gloo group (``gloo_group_from_env``, from the environment Podium gives a
worker group) forms over Podium's key-checked store, not a torch ``TCPStore`` open to anyone
(issue #48): two ranks in two processes allreduce, and torch's own store client, without the
key, can neither join nor write while the group lives."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

RANK = """
import sys, time, torch, torch.distributed as dist
from podium.rollout.recipes.grpo import gloo_group_from_env
group = gloo_group_from_env()
t = torch.full((3,), float(int(sys.argv[1]) + 1))
group.allreduce([t]).wait()
print("sum", t.tolist(), flush=True)
sys.stdin.readline()  # the group stays up until the test has probed it
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_grpo_gloo_group_rendezvous_serves_only_the_token_holders():
    import datetime

    import torch.distributed as dist

    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PODIUM_TOKEN=secrets.token_urlsafe(16))
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank)], env=dict(env, RANK=str(rank)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        for proc in ranks:
            assert proc.stdout.readline().strip() == "sum [3.0, 3.0, 3.0]"
        with pytest.raises((RuntimeError, OSError)):  # a client without the key
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
            store.set("grpo/0", "forged")
        with pytest.raises(ConnectionRefusedError):  # another address of this host: nothing there
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        for proc in ranks:
            proc.stdin.close()
            proc.wait(30)
