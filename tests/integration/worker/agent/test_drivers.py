"""The node agent's drivers (podium.worker.agent.drivers): a bad request is refused before
anything starts (ids, folders, a package that escapes its folder, an empty command), a driver's
output is one log read from any offset with its exit code once it ended, a stop ends a driver
that ignores nothing within its grace, and an ended driver's folder goes when it is forgotten."""

from __future__ import annotations

import io
import sys
import zipfile

import pytest

from podium import errors
from podium.v1 import node_pb2
from podium.worker.agent.drivers import Drivers


def _zip(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


async def _read_all(drivers: Drivers, driver_id: str) -> tuple[bytes, int]:
    import asyncio
    data, offset = b"", 0
    while True:
        reply = drivers.read(node_pb2.ReadDriverLogRequest(driver_id=driver_id, offset=offset, max_bytes=7))
        data += reply.data
        offset = reply.next_offset
        if reply.ended and not reply.data:
            return data, reply.exit_code
        if not reply.data:
            await asyncio.sleep(0.05)


def test_drivers_refuse_bad_requests_run_log_and_stop(tmp_path, arun):
    async def scenario():
        drivers = Drivers(tmp_path / "drivers")
        bad = [node_pb2.StartDriverRequest(driver_id="../x", argv=["true"]),
               node_pb2.StartDriverRequest(driver_id="a", argv=[]),
               node_pb2.StartDriverRequest(driver_id="a", argv=["true"], cwd="../elsewhere"),
               node_pb2.StartDriverRequest(driver_id="a", argv=["true"], packages=[
                   node_pb2.DriverPackage(folder="/etc", zip=_zip({"f": "x"}))])]
        for request in bad:
            with pytest.raises(errors.InvalidArgumentError):
                await drivers.start(request)
        with pytest.raises(errors.InvalidArgumentError, match="leaves its folder"):
            await drivers.start(node_pb2.StartDriverRequest(driver_id="a", argv=["true"], packages=[
                node_pb2.DriverPackage(folder="working_dir", zip=_zip({"../escape.py": "x"}))]))
        assert not (tmp_path / "drivers" / "escape.py").exists()

        started = await drivers.start(node_pb2.StartDriverRequest(
            driver_id="ok", argv=["/bin/sh", "-c", f"cat here.txt; {sys.executable} -c 'import mod; print(mod.V)'; "
                                                   "echo err >&2; exit 3"],
            env={"WHO": "x"}, cwd="working_dir", python_path=["py_modules/0"],
            packages=[node_pb2.DriverPackage(folder="working_dir", zip=_zip({"here.txt": "from the working dir\n"})),
                      node_pb2.DriverPackage(folder="py_modules/0", zip=_zip({"mod.py": "V = 42\n"}))]))
        assert started.pid > 0
        data, code = await _read_all(drivers, "ok")
        assert code == 3 and b"from the working dir\n42\nerr\n" in data, data
        with pytest.raises(errors.AlreadyExistsError):
            await drivers.start(node_pb2.StartDriverRequest(driver_id="long", argv=["sleep", "60"]))
            await drivers.start(node_pb2.StartDriverRequest(driver_id="long", argv=["sleep", "60"]))
        assert await drivers.stop("long", 0.5) is True
        _, code = await _read_all(drivers, "long")
        assert code != 0
        assert await drivers.stop("ok") is False  # ended: forgotten, its folder gone
        assert not (tmp_path / "drivers" / "ok").exists()
        with pytest.raises(errors.NotFoundError):
            drivers.read(node_pb2.ReadDriverLogRequest(driver_id="ok"))
        await drivers.stop_all()
        assert not (tmp_path / "drivers" / "long").exists()
    arun(scenario(), timeout=120)
