"""Under `podium run`: ray.util.collective's rendezvous after a failed attempt (issue #48).

Prints ``name: value`` lines for test_collective_rendezvous.py. Attempt one's rank 0 is
killed after it published its store's address; a listener that answers nothing (someone
else's, or a stale socket) then holds that port. Attempt two's rank 1 starts first and finds
the old address: it must wait for attempt two's rank 0, not talk to whoever holds the port.
A rank 0 whose rendezvous fails removes the actor."""

import socket
import time

import ray
import ray.util.collective as col
import torch


@ray.remote(num_cpus=1)
class Member:
    def join(self, world, rank, group, timeout=None):
        import podium.compat.collective as impl

        if timeout is not None:
            impl.TIMEOUT_S = timeout
        try:
            col.init_collective_group(world, rank, "gloo", group)
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            return f"failed: {type(exc).__name__}"
        tensor = torch.full((2,), float(rank + 1))
        col.allreduce(tensor, group)
        return tensor.tolist()


def lookup(name):
    try:
        return ray.get(ray.get_actor(name).lookup.remote())
    except ValueError:
        return None


ray.init()
# The driver makes the rendezvous actor, so it outlives the rank that is killed below (an
# actor a killed rank made may go with it, which would leave nothing stale to test).
from podium.compat.collective import _rendezvous  # noqa: E402

keeper = _rendezvous("g")
first = Member.remote()
first.join.remote(2, 0, "g")  # waits for a rank 1 that never comes
while (address := lookup("podium-collective:g")) is None:
    time.sleep(0.05)
host, port = address[0], address[1]
ray.kill(first)
while True:  # its store is gone once the process is
    try:
        socket.create_connection((host, port), timeout=1).close()
        time.sleep(0.05)
    except OSError:
        break
squatter = socket.socket()
squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
squatter.bind((host, port))
squatter.listen(8)
squatter.settimeout(120)
second = Member.remote()
late = second.join.remote(2, 1, "g")
conn, _ = squatter.accept()  # rank 1 dialled the old address
print(f"rank 1 reached the old port: {bool(conn)}")
zero = Member.remote()
early = zero.join.remote(2, 0, "g")
print(f"collective: {ray.get([early, late], timeout=150)}")
conn.close()
squatter.close()

# A rank 0 whose peers never come: its rendezvous fails, and the actor goes with it.
alone = Member.remote()
print(f"alone: {ray.get(alone.join.remote(2, 0, 'h', timeout=3), timeout=120)}")
print(f"actor left: {lookup('podium-collective:h') is not None}")
ray.shutdown()
print("SCENARIO OK")
