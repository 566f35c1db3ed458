"""A mutual-TLS cluster of real processes, end to end, and what must never leak from it.

``podium scheduler`` and two ``podium node`` agents (127.0.0.2, 127.0.0.3) run with
``--tls-cert/--tls-key/--tls-ca`` (certificates generated here with ``cryptography``);
the controller joins with ``init(tls=...)``; the agents hand the same files to their
workers (PODIUM_TLS_*), which serve TLS and fetch futures from each other over it.
Each node has one (fake) GPU, so a two-rank GPU group spans both nodes. Plaintext and
foreign-CA clients fail cleanly on every service. The token shows up in
no log file, no /v1 response and no WorkerInfo.env.
"""

from __future__ import annotations

import os
import pathlib
import ssl
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.certs import make_foreign_tls, make_tls
import podium
from podium import errors, rpc
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.controller.session.runtime import get_runtime
from podium import DataProtoFuture
from podium.dataproto import DataProto
from podium.v1 import common_pb2, node_pb2, node_pb2_grpc
from podium.worker import Dispatch, Worker, register
from tests.support.clusters import TWO_NODES, two_node_processes
from tests.support.waiting import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.faults, pytest.mark.timeout(300)]

NODES = TWO_NODES


class Producer(Worker):
    """Keeps its rows in the worker (blocking=False) and reports its TLS environment."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        data.batch["a"] += 100 * self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tls_env(self):
        return {k: os.environ.get(k) for k in ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA",
                                               "PODIUM_NODE_ADDRESS")}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, a, b):
        self.calls = getattr(self, "calls", 0) + 1
        return a + b

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_count(self):
        return getattr(self, "calls", 0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self):
        raise RuntimeError("failing on purpose, with no secret in the message")


class Consumer(Worker):
    """Gets a future: fetches the rows from the producers itself (worker to worker)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data):
        return DataProto.from_dict(tensors={"a": data.batch["a"] * 10,
                                            "node": torch.full((len(data),), int(
                                                os.environ["PODIUM_NODE_ADDRESS"].rsplit(".", 1)[1]))})


class TlsCluster:
    """What the tests need to reach the processes."""

    def __init__(self, tmp: pathlib.Path, token: str, tls, address: str, http_port: int, agents: dict):
        self.tmp, self.token, self.tls = tmp, token, tls
        self.address = address
        self.http_url = f"https://127.0.0.1:{http_port}"
        self.http_port = http_port
        self.agents = agents  # node address -> agent "host:port"


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-cluster")
    tls = make_tls(tmp / "certs")
    flags = ("--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca)
    with two_node_processes(tmp, gpus_per_node=1, cpus=8, flags=flags) as procs:
        rt = podium.init(address=procs.address, token=procs.token, tls=tls)
        try:
            eventually(lambda: len(rt.run(rt.cluster_state()).nodes) >= 2, "both nodes to register", 30)
            yield TlsCluster(tmp, procs.token, tls, procs.address, procs.http_port, procs.agent_addresses)
        finally:
            podium.shutdown()


@pytest.fixture(scope="module")
def producers(tls_cluster):
    wg = WorkerGroup(ResourcePool([1, 1], use_gpu=True, max_colocate_count=2), ClassWithInitArgs(Producer))
    yield wg
    wg.shutdown()


def test_groups_and_worker_to_worker_futures_over_mutual_tls(tls_cluster, producers):
    tls = tls_cluster.tls
    envs = producers.tls_env()
    assert [e["PODIUM_NODE_ADDRESS"] for e in envs] == list(NODES)
    assert all((e["PODIUM_TLS_CERT"], e["PODIUM_TLS_KEY"], e["PODIUM_TLS_CA"]) == (tls.cert, tls.key, tls.ca)
               for e in envs)
    consumers = WorkerGroup(ResourcePool([1, 1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Consumer))
    try:
        future = producers.make(DataProto.from_dict(tensors={"a": torch.arange(4)}))
        assert isinstance(future, DataProtoFuture)
        rt = get_runtime()
        fetched = rt.stats["fetches"]
        out = consumers.consume(future)
        # Rows 0-1 came from rank 0 on .2, rows 2-3 from rank 1 on .3 (one GPU per node),
        # so some crossed nodes, worker to worker, over TLS; none went through this process.
        assert out.batch["a"].tolist() == [0, 10, 1020, 1030]
        assert set(out.batch["node"].tolist()) <= {2, 3}
        assert rt.stats["fetches"] == fetched
    finally:
        consumers.shutdown()


def _health(channel, metadata=()) -> grpc.RpcError | None:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata,
                                                  timeout=5)
    except grpc.RpcError as exc:
        return exc
    return None


def _raw_hello(host: str, port: int, token: str, tls) -> bytes:
    """The raw call socket's answer to a hello (b"\\x00" accepted, b"\\x01" wrong token,
    b"" closed), over plaintext (``tls`` None) or mutual TLS with ``tls``'s certificate."""
    import socket
    import struct

    from podium.transport import callsocket

    raw = socket.create_connection((host, port), timeout=10)
    sock = tls.ssl_context(server=False).wrap_socket(raw, server_hostname=host) if tls is not None else raw
    with sock:
        sock.sendall(struct.pack("<4sBH", callsocket.MAGIC, callsocket.VERSION, len(token)) + token.encode())
        try:
            return sock.recv(1)
        except (ConnectionResetError, TimeoutError):
            return b""


def test_plaintext_and_foreign_clients_fail_cleanly_on_every_service(tls_cluster, producers, tmp_path):
    rt = get_runtime()
    workers = [f"{w.node_address}:{w.port}" for w in rt.run(rt.cluster_state()).workers
               if w.state == common_pb2.WORKER_RUNNING]
    assert len(workers) >= 2
    targets = {"scheduler": tls_cluster.address, **{f"agent {h}": a for h, a in tls_cluster.agents.items()},
               **{f"worker {a}": a for a in workers}}
    # Under TLS a worker's raw call socket (podium.transport.callsocket) speaks mutual TLS too:
    # plaintext and a foreign CA never reach the token check; the right certificate still
    # needs the token.
    from podium.v1 import worker_pb2, worker_pb2_grpc
    foreign = make_foreign_tls(tmp_path)
    for address in workers:
        with rpc.make_sync_channel(address, tls_cluster.tls) as channel:
            described = worker_pb2_grpc.WorkerStub(channel).Describe(
                worker_pb2.DescribeRequest(), metadata=rpc.token_metadata(tls_cluster.token), timeout=10)
        host, port = address.rsplit(":", 1)[0], described.call_port
        assert port, address
        assert _raw_hello(host, port, tls_cluster.token, None) == b"", address
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            _raw_hello(host, port, tls_cluster.token, foreign)
        assert _raw_hello(host, port, tls_cluster.token + "x", tls_cluster.tls) == b"\x01", address
        assert _raw_hello(host, port, tls_cluster.token, tls_cluster.tls) == b"\x00", address
    for what, address in targets.items():
        with rpc.make_sync_channel(address, tls_cluster.tls) as good:
            assert _health(good, rpc.token_metadata(tls_cluster.token)) is None, what
            # Right certificate, no token: the token is still checked behind TLS.
            assert _health(good).code() is grpc.StatusCode.UNAUTHENTICATED, what
        for label, channel in (("plaintext", grpc.insecure_channel(address)),
                               ("foreign CA", rpc.make_sync_channel(address, foreign))):
            with channel:
                error = _health(channel)
                assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE, (what, label, error)
    # The SDK's own clients say UnavailableError, within their deadline, never a hang.
    from podium.scheduler.client import SchedulerClient
    from podium.worker.caller.client import WorkerClient

    async def plain_clients():
        async with SchedulerClient(tls_cluster.address, tls_cluster.token, timeout=5) as client:
            with pytest.raises(errors.UnavailableError):
                await client.cluster_state()
        client = WorkerClient(workers[0], tls_cluster.token)
        try:
            with pytest.raises(errors.UnavailableError):
                await client.start(timeout=5)
        finally:
            await client.close()
        # The right certificate with a wrong token: AuthenticationError, from each service.
        async with SchedulerClient(tls_cluster.address, tls_cluster.token + "x", tls_cluster.tls, timeout=5) as client:
            with pytest.raises(errors.AuthenticationError):
                await client.cluster_state()
        client = WorkerClient(workers[0], tls_cluster.token + "x", tls=tls_cluster.tls)
        try:
            with pytest.raises(errors.AuthenticationError):
                await client.start(timeout=5)
        finally:
            await client.close()
    rt.run(plain_clients(), timeout=60)
    # HTTPS: plain HTTP and a client without a certificate are refused.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_cluster.http_port}/healthz", timeout=5).read()
    no_cert = ssl.create_default_context(cafile=tls_cluster.tls.ca)
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(tls_cluster.http_url + "/v1/nodes", timeout=5, context=no_cert).read()
    assert producers.add(1, 2) == [3, 3]


def test_bad_input_at_the_controller(tls_cluster, producers):
    # More than the cluster has: at once, per node, before any process starts.
    with pytest.raises(errors.InfeasibleError) as info:
        WorkerGroup(ResourcePool([3], use_gpu=True, max_colocate_count=1), ClassWithInitArgs(Producer))
    assert len(info.value.node_reasons) == 2, info.value
    calls = producers.call_count()
    # Unpicklable: refused here, before sending (the workers count no call).
    with pytest.raises(errors.InvalidArgumentError, match=r"\(a lock\)"):
        producers.add(threading.Lock(), 1)
    # Wrong argument count: the worker's method never runs.
    with pytest.raises(TypeError, match="missing a required argument"):
        producers.add(1)
    with pytest.raises(AttributeError):
        producers.no_such_method()
    assert producers.call_count() == calls
    assert producers.add(2, 3) == [5, 5]


def _get(url: str, token: str | None, tls) -> bytes:
    context = tls.ssl_context(server=False)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10, context=context) as resp:
        return resp.read()


def test_no_secret_in_any_response_env_or_log(tls_cluster, producers):
    token = tls_cluster.token.encode()
    with pytest.raises(errors.RemoteError):
        producers.fail()  # a traceback in the logs, too
    rt = get_runtime()
    state = rt.run(rt.cluster_state())
    workers = list(state.workers)
    assert workers
    for worker in workers:
        assert "PODIUM_TOKEN" not in worker.env and tls_cluster.token not in worker.env.values()
    assert token not in state.SerializeToString()
    # The agents' own view of their workers carries no token either.
    for address in tls_cluster.agents.values():
        with rpc.make_sync_channel(address, tls_cluster.tls) as channel:
            listed = node_pb2_grpc.NodeAgentStub(channel).ListWorkers(
                node_pb2.ListWorkersRequest(), metadata=rpc.token_metadata(tls_cluster.token), timeout=10)
        assert token not in listed.SerializeToString()
        assert all("PODIUM_TOKEN" not in w.env for w in listed.workers)
    for path in ("/", "/healthz", "/readyz", "/v1/nodes", "/v1/placement", "/v1/workers", "/metrics"):
        body = _get(tls_cluster.http_url + path, tls_cluster.token, tls_cluster.tls)
        assert body and token not in body, path
    # Every log file of the run: scheduler, agents, every worker's stdout and stderr.
    logs = [p for p in tls_cluster.tmp.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]
    assert len(logs) >= 3 + 2 * 2, logs
    key = pathlib.Path(tls_cluster.tls.key).read_bytes().split(b"\n")[1]
    for path in logs:
        data = path.read_bytes()
        assert token not in data, f"the token is in {path}"
        assert key not in data, f"the TLS key is in {path}"
