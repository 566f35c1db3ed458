"""Shared-memory segment names from a peer against what another process put in /dev/shm
(issue #48): a ``podium-*`` symlink is not followed, a file of another user (uid 65534, via
``setpriv``) is not mapped nor removed, and a weight-broadcast bucket is mapped so that the
replica's writes never reach the sender's segment."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from podium.errors import DataLossError
from podium.rollout.broadcastshm import map_bucket
from podium.transport import shm
from tests.support.seconduser import NOBODY, SECOND_USER, SYSTEM_PYTHON



def _name() -> str:
    return f"{shm.PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def test_a_symlink_named_like_a_segment_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep" * 16)
    name = _name()
    link = os.path.join(shm.SHM_DIR, name)
    os.symlink(target, link)
    try:
        try:
            view = shm.read_segment(name, unlink=False)
        except DataLossError as exc:
            assert "cannot be opened" in str(exc)
        else:  # mapped through the link: a write lands in the target
            view[:4] = b"GONE"
            view.release()
        assert target.read_bytes() == b"keep" * 16
    finally:
        os.unlink(link)


@SECOND_USER
def test_a_segment_file_of_another_user_is_neither_mapped_nor_removed():
    name = _name()
    path = os.path.join(shm.SHM_DIR, name)
    subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c",
                    f"import os; fd = os.open({path!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666); "
                    f"os.write(fd, b'planted' * 10); os.close(fd)"], check=True, timeout=30)
    try:
        assert os.stat(path).st_uid == 65534
        with pytest.raises(DataLossError, match="not a file of this user"):
            shm.read_segment(name)
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_a_broadcast_bucket_is_mapped_so_writes_stay_in_the_replica():
    name, size = shm.write_segments([bytes(range(64)) * 4])
    try:
        tensor = map_bucket(name, size, "the test")
        tensor[:8] = 255  # a loader that scribbles on what it was handed
        assert tensor[0].item() == 255
        with open(os.path.join(shm.SHM_DIR, name), "rb") as segment:
            assert segment.read() == bytes(range(64)) * 4
    finally:
        shm.remove_segment(name)


class Echo:
    """What the worker hosts: a method that returns its argument."""

    def echo(self, *args):
        return args


RELAY = """
import socket, sys, threading
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
client, _ = listener.accept()
upstream = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def pump(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
threading.Thread(target=pump, args=(upstream, client)).start()
pump(client, upstream)
"""


@SECOND_USER
def test_a_peer_of_another_user_cannot_make_a_worker_map_this_users_segment(token, arun):
    """A local user 65534 who holds the token names one of this user's segments (another
    job's, say) in a call: the worker neither maps nor removes it."""
    import asyncio
    import socket
    import struct

    from podium.transport import callsocket
    from podium.transport.frames import FRAME_LENGTH
    from podium.v1 import worker_pb2
    from podium.worker.caller.client import WorkerClient
    from podium.worker.host.process import start_host

    async def scenario():
        host = await start_host("127.0.0.1", token=token, env={"RANK": "0", "WORLD_SIZE": "1"})
        owner = WorkerClient(host.address, token)
        await owner.start()
        await owner.construct((Echo, (), {}))
        name, size = shm.write_segments([b"another job's data" * 100])
        relay = subprocess.Popen([*NOBODY, SYSTEM_PYTHON,
                                  "-c", RELAY, str(host.runtime.call_port)], stdout=subprocess.PIPE, text=True)
        try:
            port = int(relay.stdout.readline())
            frame = worker_pb2.CallFrame(call_id=1, last=True, header=worker_pb2.CallHeader(
                kind=worker_pb2.CALL, method="echo", shm_name=name, payload_size=size)).SerializeToString()

            def attack() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(callsocket.hello(token) + FRAME_LENGTH.pack(len(frame)) + frame)
                    sock.settimeout(10)
                    got = b""
                    try:
                        while len(got) < 4 or len(got) < 4 + struct.unpack("<I", got[:4])[0]:
                            chunk = sock.recv(65536)
                            if not chunk:
                                break
                            got += chunk
                    except OSError:
                        pass
                    return got

            reply = await asyncio.get_running_loop().run_in_executor(None, attack)
            assert b"named by a peer of another local user" in reply
            assert os.path.exists(os.path.join(shm.SHM_DIR, name))  # neither consumed nor removed
            assert host.runtime.stats.get("shm_in", 0) == 0
        finally:
            relay.kill()
            relay.wait(10)
            shm.remove_segment(name)
            await owner.close()
            await host.stop(grace=0.2)
    arun(scenario())
