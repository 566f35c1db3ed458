"""Mutual TLS with certificates that name no address: PODIUM_TLS_SERVER_NAME, as on Kubernetes.

Pods (and their workers) are dialled at IPs no certificate can list ahead of time, so the
Kubernetes TLS overlay gives every pod one certificate naming "podium" and sets
PODIUM_TLS_SERVER_NAME=podium. Here the certificate's only SAN is that name: a scheduler
and two agents (127.0.0.2, 127.0.0.3) run with it, the agents register, a controller runs
a WorkerGroup whose futures move worker to worker, and the health probe passes; the same
probe without the variable fails (the name check is real). Adds about 15 s.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.certs import make_tls
import podium
from podium.auth import TlsConfig
from podium.cli import healthprobe
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.dataproto import DataProto
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import two_node_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

NAME = "podium"


class Doubler(Worker):
    """Keeps its result in the worker: the next group fetches it from here, over TLS."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double(self, data):
        data.batch["a"] = data.batch["a"] * 2
        return data


class Adder(Worker):
    """Receives the future: fetches the rows from the Doubler workers itself."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data):
        data.batch["a"] = data.batch["a"] + 1
        return data


def test_one_name_for_every_address(tmp_path, monkeypatch):
    tls = make_tls(tmp_path / "certs", names=(NAME,))
    for key in ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA"):
        monkeypatch.delenv(key, raising=False)
    # Every process below (and the agents' workers) inherits it, as the pods' env gives it.
    monkeypatch.setenv("PODIUM_TLS_SERVER_NAME", NAME)
    flags = ("--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca)
    with two_node_processes(tmp_path, gpus_per_node=1, cpus=8, flags=flags) as procs:
        client_tls = TlsConfig.from_paths(tls.cert, tls.key, tls.ca)
        assert client_tls.server_name == NAME
        rt = podium.init(address=procs.address, token=procs.token, tls=client_tls)
        try:
            deadline = time.monotonic() + 60
            while len(rt.run(rt.cluster_state()).nodes) < 2:  # the agents reached the scheduler
                assert time.monotonic() < deadline, "nodes did not register over TLS"
                time.sleep(0.1)
            first = WorkerGroup(ResourcePool([1, 1], use_gpu=True, max_colocate_count=2), ClassWithInitArgs(Doubler))
            second = WorkerGroup(ResourcePool([1, 1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Adder))
            out = second.add(first.double(DataProto.from_dict(tensors={"a": torch.arange(4)})))
            assert out.batch["a"].tolist() == [1, 3, 5, 7]
        finally:
            podium.shutdown()

        monkeypatch.setenv("PODIUM_TLS_CERT", tls.cert)
        monkeypatch.setenv("PODIUM_TLS_KEY", tls.key)
        monkeypatch.setenv("PODIUM_TLS_CA", tls.ca)
        monkeypatch.setenv("PODIUM_TOKEN", procs.token)
        for target in [procs.address, *procs.agent_addresses.values()]:
            assert healthprobe.probe_grpc(target) is None, target
        monkeypatch.delenv("PODIUM_TLS_SERVER_NAME")
        problem = healthprobe.probe_grpc(procs.address)
        assert problem is not None and "UNAVAILABLE" in problem, problem
