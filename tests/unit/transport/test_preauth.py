"""The pre-authentication gate of the raw call socket (podium.transport.preauth): it holds
at most PER_PEER pending connections of a peer and LIMIT in all, and makes room by closing
the oldest pending connection of the most crowded peer, never the newcomer."""

from __future__ import annotations

from podium import errors
from podium.transport.preauth import PreAuthGate


class Conn:
    """A pending connection: what the gate calls on it is recorded."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.aborted: BaseException | None = None

    def abort(self, exc: BaseException) -> None:
        self.aborted = exc


def test_a_peer_at_its_bound_loses_its_oldest_pending_connection():
    gate = PreAuthGate(limit=100, per_peer=3)
    mine = [Conn(f"a{i}") for i in range(5)]
    for conn in mine:
        gate.admit(conn, "10.0.0.1")
    assert [c.aborted is not None for c in mine] == [True, True, False, False, False]
    assert isinstance(mine[0].aborted, errors.ResourceExhaustedError)
    assert len(gate) == 3 and gate.evicted == 2


def test_over_the_process_bound_the_most_crowded_peer_pays():
    gate = PreAuthGate(limit=4, per_peer=10)
    attacker = [Conn(f"x{i}") for i in range(3)]
    for conn in attacker:
        gate.admit(conn, "10.0.0.66")
    client = Conn("client")
    gate.admit(client, "10.0.0.2")
    newcomer = Conn("other")
    gate.admit(newcomer, "10.0.0.3")  # full: the attacker's oldest goes, not the client
    assert attacker[0].aborted is not None and client.aborted is None and newcomer.aborted is None
    assert len(gate) == 4


def test_authenticated_or_closed_connections_leave_the_gate():
    gate = PreAuthGate(limit=2, per_peer=2)
    first, second = Conn("1"), Conn("2")
    gate.admit(first, "p")
    gate.admit(second, "p")
    gate.leave(first)
    gate.leave(first)  # twice is harmless (handshake, then connection_lost)
    third = Conn("3")
    gate.admit(third, "p")
    assert second.aborted is None and third.aborted is None and len(gate) == 2
