"""runtime_env ``working_dir`` / ``py_modules`` given as a package URI: fetched by the node that
hosts the worker, unpacked once into a private cache, then used as a local path is.

- ``gcs://_ray_pkg_<hash>.zip``: a package uploaded to the cluster (``ray job submit
  --working-dir`` and ``podium job submit`` upload them), read from the scheduler's
  ``Packages.ReadPackage`` with the cluster token and the node's TLS, as every RPC.
- ``https://.../x.zip``: read with aiohttp (no cluster token: it is not the cluster's).

Other schemes are refused where the runtime_env is given (:mod:`podium.runtimeenv`). A package
is at most :data:`~podium.zippackage.MAX_PACKAGE_BYTES` (the jobs' upload bound) and is checked
(paths, entries, unpacked size) before it is unpacked.

The cache (:data:`CACHE_DIR` under the node's log folder, private) holds ``<key>/`` (the
unpacked package: the name of a ``gcs://`` package, content-addressed, or the hash of an https
URI), ``<key>.ready`` (written last; a folder without it is half made and is made again) and
``<key>.lock``, held as in :mod:`podium.worker.agent.pipenv`: exclusively by the one fetching,
shared by each worker using the package for its life, so eviction (:data:`MAX_PACKAGES`
packages, least recently used first) never removes one in use.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import sys
import time
from typing import BinaryIO, Mapping

from podium.private import private_dir
from podium.worker.agent.pipenv import SETUP_SECONDS, SetupFailed, evict_unused, open_lock
from podium.zippackage import MAX_PACKAGE_BYTES, unpack

__all__ = ["CACHE_DIR", "MAX_PACKAGES", "is_uri", "cache_key", "fetch"]

#: The cache's folder under the node agent's log folder.
CACHE_DIR = "runtime_envs/packages"
#: At most this many unpacked packages in one node's cache (a count; each is at most
#: MAX_UNPACKED_BYTES). Fetching one more first removes the least recently used unused ones.
MAX_PACKAGES = 64
_GCS_NAME = re.compile(r"^gcs://(_ray_pkg_[0-9a-f]{16,64})\.zip$")


def is_uri(text: str) -> bool:
    """Whether a runtime_env path is a package URI."""
    return "://" in text


def cache_key(uri: str) -> str:
    """The cache folder name of ``uri``."""
    match = _GCS_NAME.match(uri)
    if match:
        return match.group(1)
    return "https_" + hashlib.sha256(uri.encode()).hexdigest()[:32]


def _read_gcs(uri: str, out: BinaryIO, env: Mapping[str, str]) -> None:
    import grpc

    from podium.auth import TlsConfig
    from podium.rpc import error_from_rpc, make_sync_channel, token_metadata
    from podium.v1 import scheduler_pb2, scheduler_pb2_grpc
    address = env.get("PODIUM_SCHEDULER", "")
    if not address:
        raise SetupFailed(f"{uri}: this worker has no PODIUM_SCHEDULER to read the package from")
    tls = TlsConfig.from_paths(env.get("PODIUM_TLS_CERT"), env.get("PODIUM_TLS_KEY"), env.get("PODIUM_TLS_CA"))
    total = 0
    with make_sync_channel(address, tls) as channel:
        stub = scheduler_pb2_grpc.PackagesStub(channel)
        try:
            for chunk in stub.ReadPackage(scheduler_pb2.ReadPackageRequest(uri=uri), timeout=SETUP_SECONDS,
                                          metadata=token_metadata(env.get("PODIUM_TOKEN", ""))):
                total += len(chunk.data)
                if total > MAX_PACKAGE_BYTES:
                    raise SetupFailed(f"{uri} is over {MAX_PACKAGE_BYTES} bytes")
                out.write(chunk.data)
        except grpc.RpcError as exc:
            raise SetupFailed(f"reading {uri} from the scheduler at {address}: "
                              f"{error_from_rpc(exc, what='ReadPackage')}") from None


async def _read_https(uri: str, out: BinaryIO) -> None:
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=SETUP_SECONDS)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(uri) as response:
                if response.status != 200:
                    raise SetupFailed(f"GET {uri}: HTTP {response.status} {response.reason}")
                if (response.content_length or 0) > MAX_PACKAGE_BYTES:
                    raise SetupFailed(f"{uri} is {response.content_length} bytes; at most {MAX_PACKAGE_BYTES}")
                total = 0
                async for data in response.content.iter_chunked(1 << 20):
                    total += len(data)
                    if total > MAX_PACKAGE_BYTES:
                        raise SetupFailed(f"{uri} is over {MAX_PACKAGE_BYTES} bytes")
                    out.write(data)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise SetupFailed(f"GET {uri}: {type(exc).__name__}: {exc}") from None


def _download(uri: str, staged: pathlib.Path, env: Mapping[str, str]) -> None:
    with open(staged, "wb") as out:
        if uri.startswith("gcs://"):
            _read_gcs(uri, out, env)
        elif uri.startswith("https://"):
            asyncio.run(_read_https(uri, out))
        else:  # podium.runtimeenv refuses these where they are given; a spec may come from elsewhere
            raise SetupFailed(f"{uri}: Podium fetches gcs:// and https:// packages only")


def fetch(cache: str | os.PathLike, uri: str, env: Mapping[str, str] | None = None,
          limit: int = MAX_PACKAGES) -> tuple[str, int]:
    """``(folder, fd)``: where ``uri`` is unpacked on this node (fetched first if needed), and a
    descriptor holding its lock shared (keep it open while the package is in use).
    SetupFailed when it cannot be fetched or is not a valid package (nothing half made stays)."""
    env = os.environ if env is None else env
    folder = private_dir(cache)
    key = cache_key(uri)
    target, ready, lock = folder / key, folder / f"{key}.ready", folder / f"{key}.lock"
    fd = open_lock(lock, fcntl.LOCK_SH)
    if ready.exists():
        os.utime(ready)
        return str(target), fd
    os.close(fd)
    fd = open_lock(lock, fcntl.LOCK_EX)
    try:
        if not ready.exists():
            shutil.rmtree(target, ignore_errors=True)
            evict_unused(folder, key, limit, lambda entry: entry.parent / f"{entry.name}.ready")
            staged = folder / f".{key}.{os.getpid()}.zip"
            started = time.monotonic()
            try:
                _download(uri, staged, env)
                unpack(staged, target)  # checks it first: paths, entries, unpacked size
            except SetupFailed:
                shutil.rmtree(target, ignore_errors=True)
                raise
            except Exception as exc:  # noqa: BLE001 - a bad zip, a full disk: the worker's error
                shutil.rmtree(target, ignore_errors=True)
                raise SetupFailed(f"{uri}: {type(exc).__name__}: {exc}") from None
            finally:
                staged.unlink(missing_ok=True)
            ready.write_text(uri)
            sys.stderr.write(f"podium: fetched {uri} into {target} in {time.monotonic() - started:.1f} s\n")
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return str(target), fd
