"""``init()`` with PODIUM_TLS_CERT/KEY/CA in the environment: the embedded scheduler, node
agent and workers all serve mutual TLS with those files, and the SDK uses them."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.certs import make_tls
import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium.worker import Dispatch, Worker, register

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


class Where(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tls(self):
        return os.environ.get("PODIUM_TLS_CERT"), self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, value):
        return value


def test_init_takes_tls_from_the_environment(tmp_path, monkeypatch):
    tls = make_tls(tmp_path / "certs")
    monkeypatch.setenv("PODIUM_TLS_CERT", tls.cert)
    monkeypatch.setenv("PODIUM_TLS_KEY", tls.key)
    monkeypatch.setenv("PODIUM_TLS_CA", tls.ca)
    monkeypatch.delenv("PODIUM_ADDRESS", raising=False)
    podium.shutdown()
    rt = podium.init(num_gpus=1, log_dir=str(tmp_path / "run"))
    try:
        assert rt.tls == tls
        wg = WorkerGroup(ResourcePool([1], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Where))
        try:
            assert wg.tls() == [(tls.cert, 0)]
            # Calls take the raw call socket under mutual TLS; a large payload goes as one
            # bulk frame each way (written in slices) and comes back bit for bit.
            client = wg.workers[0].client
            assert client.transport == "socket"
            client.same_host = False  # as if remote: no shared memory
            value = {"t": torch.randn(5 << 18)[::2], "b": torch.rand(3 << 20) > 0.5,
                     "objs": np.array([{"a": 1}, "x", None], dtype=object)}
            sent = client.stats["bulk_sent"], client.stats["bulk_received"]
            (back,) = wg.echo(value)
            assert (client.stats["bulk_sent"], client.stats["bulk_received"]) == (sent[0] + 1, sent[1] + 1)
            assert torch.equal(back["t"], value["t"]) and torch.equal(back["b"], value["b"])
            assert list(back["objs"]) == list(value["objs"])
        finally:
            wg.shutdown()
        # The embedded scheduler refuses a plaintext client.
        with grpc.insecure_channel(get_runtime().address) as plain:
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        podium.shutdown()
