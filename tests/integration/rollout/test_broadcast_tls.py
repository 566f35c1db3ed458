"""The weight-broadcast chain under the cluster's mutual TLS (issue #48): with
``PODIUM_TLS_CERT``/``KEY``/``CA`` set, as in every worker of a TLS cluster, neither the
per-update token nor the weights cross the wire in clear (a recording proxy sits between the
sender and the chain's head), and a client without a certificate is refused before its HELLO
is read, token or not."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from podium.rollout import broadcast, broadcastshm
from podium.rollout.broadcast import WeightReceiver, WeightSender, build_topology

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _cluster_tls(tls, monkeypatch):
    monkeypatch.setenv("PODIUM_TLS_CERT", tls.cert)
    monkeypatch.setenv("PODIUM_TLS_KEY", tls.key)
    monkeypatch.setenv("PODIUM_TLS_CA", tls.ca)
    yield
    broadcastshm.SENDER.close()


class RecordingProxy:
    """Forwards one connection to ``target`` and keeps every byte it carried."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.seen = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        pumps = [threading.Thread(target=self._pump, args=(a, b)) for a, b in ((client, upstream), (upstream, client))]
        for pump in pumps:
            pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_the_chain_is_tls_and_a_client_without_a_certificate_is_refused():
    first, second = WeightReceiver(name="first", timeout=30), WeightReceiver(name="second", timeout=30)
    head, downs = build_topology([dict(first.prepare(), shm_domain=""), dict(second.prepare(), shm_domain="")])
    results: dict[str, object] = {}

    def receive(receiver, downstream):
        try:
            results[receiver.name] = dict(receiver.receive(downstream, 1))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[receiver.name] = exc

    threads = [threading.Thread(target=receive, args=(r, d)) for r, d in ((first, downs[0]), (second, downs[1]))]
    for thread in threads:
        thread.start()
    # Plain TCP with the right token: refused at the TLS handshake, the HELLO never read.
    plain = socket.create_connection((head["host"], head["port"]), timeout=10)
    plain.sendall(broadcast._frame_head(broadcast._HELLO, {"token": head["token"], "step": 1}))
    reply = b""
    try:
        while chunk := plain.recv(4096):
            reply += chunk
    except ConnectionResetError:  # closed with our HELLO unread
        pass
    plain.close()
    assert b"PDWB" not in reply
    marker = torch.full((4096,), 1234.5678)
    proxy = RecordingProxy((head["host"], head["port"]))
    sent = WeightSender(timeout=30).send([("w", marker)], dict(head, port=proxy.port), step=1)
    for thread in threads:
        thread.join(60)
    assert sent["tensors"] == 1
    for name in ("first", "second"):
        got = results[name]
        assert isinstance(got, dict) and torch.equal(got["w"], marker), got
    assert proxy.seen and head["token"].encode() not in proxy.seen
    assert marker.numpy().tobytes()[:64] not in proxy.seen and b"PDWB" not in proxy.seen
