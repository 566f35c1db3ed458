"""The machine's own limits, measured in the same run as the cells they bound.

    python -m bench.floors [--mib 128] [--repeat 5] [--fanout N]

On a 2-core VM the loopback stream alone moves anywhere from ~1,500 to ~4,000 MB/s from
one hour (or one process placement) to the next, so a Podium cell means little without the
limit measured beside it. ``python -m bench.crosshost`` runs this before and after its modes
and reports each cross-host cell against it. Three limits, each the median of ``--repeat``
after one warm-up, between two fresh processes (each on whatever core the kernel gives it,
as Podium's processes are):

- ``tcp``: one way over loopback TCP on uvloop, the way the raw call socket moves a bulk
  payload but with no framing, codec or pool: one ``write`` of a reused buffer, received
  by a ``BufferedProtocol`` straight into a reused buffer;
- ``tls``: the same over uvloop's TLS with the cluster's kind of certificates, written in
  1 MiB slices (as the raw call socket writes bulk payloads under TLS);
- ``memcpy``: one ``memmove`` of the payload between two reused buffers (one way).

``--fanout N`` measures instead the floors of a no-op group call at N ranks (:func:`fanout`):
what 2 cores do when N Python processes each answer one small frame with no framework, on
uvloop, from a thread blocking in ``recv``, and doing the least Podium's frames need; the
last line has that least work answered to a sender on uvloop that parses every reply (the
floor of a controller's own CPU on an event loop).

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time

__all__ = ["measure_floors", "fanout", "FLOORS", "FANOUT_KINDS", "FANOUT_SENDERS"]

_SLICE = 1 << 20


def _tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from podium.auth import TlsConfig
    from tests.support.certs import make_tls

    tls: TlsConfig = make_tls(tempfile.mkdtemp())
    server = tls.ssl_context(server=True)
    client = tls.ssl_context(server=False)
    client.check_hostname = False
    return server, client


def _stream(size: int, repeat: int, tls: bool) -> float:
    """MB/s of one payload of ``size`` bytes from this process to a forked receiver (see
    the module docstring), the median of ``repeat`` after a warm-up."""
    import uvloop

    server_ctx, client_ctx = _tls_contexts() if tls else (None, None)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the receiver: a BufferedProtocol filling one reused buffer
        try:
            async def serve() -> None:
                done = asyncio.get_running_loop().create_future()

                class Receiver(asyncio.BufferedProtocol):
                    def connection_made(self, transport):  # noqa: ANN001
                        self.transport, self.view, self.got = transport, memoryview(bytearray(size)), 0

                    def get_buffer(self, sizehint: int) -> memoryview:
                        return self.view[self.got:]

                    def buffer_updated(self, nbytes: int) -> None:
                        self.got += nbytes
                        if self.got == size:  # one payload in: acknowledge, take the next
                            self.got = 0
                            self.transport.write(b"k")

                    def connection_lost(self, exc):  # noqa: ANN001
                        done.done() or done.set_result(None)

                server = await asyncio.get_running_loop().create_server(Receiver, "127.0.0.1", 0, ssl=server_ctx)
                os.write(ready_w, str(server.sockets[0].getsockname()[1]).encode())
                await asyncio.wait_for(done, 600)

            uvloop.run(serve())
        finally:
            os._exit(0)
    os.close(ready_w)
    port = int(os.read(ready_r, 16))
    os.close(ready_r)

    async def send() -> list[float]:
        loop = asyncio.get_running_loop()
        state: dict = {"ack": None, "room": None}

        class Sender(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                state["ack"].set_result(None)

            def pause_writing(self) -> None:
                state["room"] = loop.create_future()

            def resume_writing(self) -> None:
                state["room"].set_result(None)

        transport, _ = await loop.create_connection(Sender, "127.0.0.1", port, ssl=client_ctx,
                                                    server_hostname="localhost" if tls else None)
        data = memoryview(bytearray(os.urandom(_SLICE)) * (size // _SLICE))
        step = _SLICE if tls else size  # as the raw call socket writes a bulk payload
        times = []
        for _ in range(repeat + 1):
            state["ack"] = loop.create_future()
            started = time.perf_counter()
            for at in range(0, size, step):
                room = state["room"]
                if room is not None and not room.done():
                    await room
                transport.write(data[at:at + step])
            await asyncio.wait_for(state["ack"], 120)
            times.append(time.perf_counter() - started)
        transport.close()
        return times

    times = uvloop.run(send())
    os.waitpid(pid, 0)
    return size / statistics.median(times[1:]) / 1e6


def _memcpy(size: int, repeat: int) -> float:
    """MB/s of one ``memmove`` of ``size`` bytes, the median of ``repeat`` after a warm-up."""
    source, target = bytearray(os.urandom(_SLICE)) * (size // _SLICE), bytearray(size)
    src = ctypes.addressof((ctypes.c_char * size).from_buffer(source))
    dst = ctypes.addressof((ctypes.c_char * size).from_buffer(target))
    times = []
    for _ in range(repeat + 1):
        started = time.perf_counter()
        ctypes.memmove(dst, src, size)
        times.append(time.perf_counter() - started)
    return size / statistics.median(times[1:]) / 1e6


def _echo_uvloop(sock: socket.socket) -> None:
    """Answer each read with its bytes, on a uvloop protocol."""
    import uvloop

    async def echo() -> None:
        lost = asyncio.get_running_loop().create_future()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport):  # noqa: ANN001
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                self.transport.write(data)

            def connection_lost(self, exc):  # noqa: ANN001
                lost.done() or lost.set_result(None)

        await asyncio.get_running_loop().create_connection(Echo, sock=sock)
        await asyncio.wait_for(lost, 600)

    uvloop.run(echo())


def _echo_blocking(sock: socket.socket) -> None:
    """Answer each read with its bytes, one thread blocking in ``recv``."""
    while data := sock.recv(4096):
        sock.send(data)


class _NoopHost:
    def noop(self) -> None:
        """The method each call runs."""


def _serve_wire(sock: socket.socket) -> None:
    """Podium's wire without Podium: read length-prefixed CallFrames in one blocking thread,
    parse each, decode its arguments, call the method they name, send the ReplyFrame."""
    from podium import codec
    from podium.transport.frames import frame_with_call_id
    from podium.v1 import worker_pb2
    from podium.worker.host.results import NONE_OUTCOME

    length, host, buffer, tail = struct.Struct("<I"), _NoopHost(), bytearray(), NONE_OUTCOME.reply_tail()
    while data := sock.recv(65536):
        buffer += data
        while len(buffer) >= 4 and len(buffer) >= 4 + length.unpack_from(buffer)[0]:
            size = length.unpack_from(buffer)[0]
            frame = worker_pb2.CallFrame.FromString(bytes(buffer[4:4 + size]))
            del buffer[:4 + size]
            args, kwargs = codec.decode(frame.data)
            getattr(host, frame.header.method)(*args, **kwargs)
            reply = frame_with_call_id(frame.call_id, tail)
            sock.send(length.pack(len(reply)) + reply)


#: The fan-out floors: what each of the N processes runs per call.
FANOUT_KINDS = {"uvloop": _echo_uvloop, "blocking": _echo_blocking, "wire": _serve_wire}


def fanout(n: int, calls: int = 300, kind: str = "uvloop", sender: str = "select") -> dict[str, float]:
    """The floor of a no-op ``ONE_TO_ALL`` at ``n`` ranks: ``n`` forked processes that each
    answer a frame (no framework), one sender writing to all and waiting for every answer.
    ``kind`` (:data:`FANOUT_KINDS`): ``uvloop`` echoes on a uvloop protocol, ``blocking``
    echoes from one thread blocking in ``recv``, ``wire`` runs the least a worker must do
    with Podium's frames (parse, decode the arguments, call the method, reply) in one such
    thread. ``sender`` (:data:`FANOUT_SENDERS`): ``select`` sends and receives with plain
    blocking calls on a selector; ``uvloop`` is the least a controller on an event loop
    must do (a uvloop protocol per rank that parses each reply frame and decodes its value).
    Median and p90 in ms; the CPU of the sender (``sender_us_per_rank``: what a
    controller's fan-out cannot go below) and of the N processes (``ranks_us_per_rank``),
    per rank per call, over the measured calls."""
    from bench.measure import processes_cpu_seconds

    from podium import codec
    from podium.transport.frames import FRAME_LENGTH, call_frame_tail, frame_with_call_id
    from podium.v1 import worker_pb2

    serve = FANOUT_KINDS[kind]
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(n, 128))
    port = listener.getsockname()[1]
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                sock = socket.create_connection(("127.0.0.1", port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                serve(sock)
            finally:
                os._exit(0)
        pids.append(pid)
    conns = []
    for _ in range(n):
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(conn)
    tail = call_frame_tail(worker_pb2.CALL, "noop", codec.dumps(((), {})), hold=False, timeout=0,
                           reply_in_shm=False)
    messages = [FRAME_LENGTH.pack(len(frame)) + frame
                for frame in (frame_with_call_id(call_id, tail) for call_id in range(1, calls + 1))]
    warm = calls // 10  # the first tenth warms up
    cpu: list[float] = []

    def mark(index: int) -> None:  # the CPU readings around the measured calls
        if index in (warm, calls):
            cpu.extend((time.process_time(), processes_cpu_seconds(pids)))

    times = FANOUT_SENDERS[sender](conns, messages, mark)
    per_rank = 1e6 / (calls - warm) / n
    sender_us, ranks_us = (cpu[2] - cpu[0]) * per_rank, (cpu[3] - cpu[1]) * per_rank
    for conn in conns:
        conn.close()
    for pid in pids:
        os.waitpid(pid, 0)
    listener.close()
    times = sorted(times[warm:])
    return {"n": n, "kind": kind, "sender": sender, "median_ms": statistics.median(times) * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3, "sender_us_per_rank": sender_us,
            "ranks_us_per_rank": ranks_us}


def _send_select(conns: list[socket.socket], messages: list[bytes], mark) -> list[float]:
    """Each call: one ``send`` per rank, then one ``recv`` per answer as a selector reports it."""
    import selectors

    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn, selectors.EVENT_READ)
    times = []
    for index, message in enumerate(messages):
        mark(index)
        started = time.perf_counter()
        for conn in conns:
            conn.send(message)
        left = len(conns)
        while left:
            for key, _ in selector.select(timeout=10):
                key.fileobj.recv(4096)
                left -= 1
        times.append(time.perf_counter() - started)
    mark(len(messages))
    selector.close()
    return times


def _send_uvloop(conns: list[socket.socket], messages: list[bytes], mark) -> list[float]:
    """Each call: one transport write per rank; each answer is read by the rank's
    ``BufferedProtocol``, parsed as a ReplyFrame and its value decoded (the least a controller
    on an event loop does per reply)."""
    import uvloop

    from podium import codec
    from podium.v1 import worker_pb2

    length = struct.Struct("<I")
    state: dict = {"left": 0, "done": None}

    class Reader(asyncio.BufferedProtocol):
        def connection_made(self, transport):  # noqa: ANN001
            self.buffer = bytearray(1 << 16)
            self.view = memoryview(self.buffer)
            self.end = 0

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.view[self.end:]

        def buffer_updated(self, nbytes: int) -> None:
            self.end += nbytes
            buffer, pos = self.buffer, 0
            while self.end - pos >= 4 and self.end - pos >= 4 + length.unpack_from(buffer, pos)[0]:
                size = length.unpack_from(buffer, pos)[0]
                frame = worker_pb2.ReplyFrame.FromString(bytes(buffer[pos + 4:pos + 4 + size]))
                codec.decode(frame.data)
                pos += 4 + size
                state["left"] -= 1
                if not state["left"]:
                    state["done"].set_result(None)
            if pos:
                rest = self.end - pos
                buffer[:rest] = buffer[pos:self.end]
                self.end = rest

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        transports = [(await loop.connect_accepted_socket(Reader, conn))[0] for conn in conns]
        times = []
        for index, message in enumerate(messages):
            mark(index)
            state["left"], state["done"] = len(transports), loop.create_future()
            started = time.perf_counter()
            for transport in transports:
                transport.write(message)
            await state["done"]
            times.append(time.perf_counter() - started)
        mark(len(messages))
        for transport in transports:
            transport.close()
        return times

    return uvloop.run(run())


#: The fan-out floors' senders (see :func:`fanout`).
FANOUT_SENDERS = {"select": _send_select, "uvloop": _send_uvloop}


#: Each limit: a function of (payload bytes, repeats) -> MB/s.
FLOORS = {"tcp": lambda size, repeat: _stream(size, repeat, False),
          "tls": lambda size, repeat: _stream(size, repeat, True), "memcpy": _memcpy}


def measure_floors(mib: int = 128, repeat: int = 5) -> dict[str, float]:
    """MB/s of each limit (see the module docstring), measured now."""
    return {name: fn(mib << 20, repeat) for name, fn in FLOORS.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the limits as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench.floors", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fanout", type=int, metavar="N", help="instead: the no-op fan-out floors at N ranks")
    args = parser.parse_args(argv)
    if args.fanout:
        for kind, sender in [(kind, "select") for kind in FANOUT_KINDS] + [("wire", "uvloop")]:
            measured = fanout(args.fanout, kind=kind, sender=sender)
            print(json.dumps({k: round(v, 2) if type(v) is float else v for k, v in measured.items()}))
        return 0
    print(json.dumps({k: round(v) for k, v in measure_floors(args.mib, args.repeat).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
