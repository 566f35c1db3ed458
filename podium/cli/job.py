"""``podium job submit|status|logs|stop|list|delete``: ``ray job`` for people without Ray installed.

They speak the cluster's Jobs REST API (:mod:`podium.scheduler.jobshttp`, Ray's own), with the
flags of ``ray job``::

    podium job submit --address http://HEAD:8265 --working-dir . --no-wait -- python train.py
    podium job logs --follow raysubmit_...
    podium job stop raysubmit_...

``--address`` is the scheduler's HTTP URL (else ``$RAY_API_SERVER_ADDRESS``, ``$RAY_ADDRESS``
when it is an http(s) URL, else the ``podium up`` cluster in ``--dir``, else
``http://127.0.0.1:8265``). The token is found the usual way (``PODIUM_TOKEN``,
``PODIUM_TOKEN_FILE``, ``~/.podium/token``; the ``podium up`` cluster's own) and sent as
``Authorization: Bearer``. A local ``working_dir`` (or ``py_modules`` folder) is zipped and
uploaded as Ray's client does, once per content.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from podium import errors

__all__ = ["main", "zip_folder"]

_SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"}
_TERMINAL = {"STOPPED", "SUCCEEDED", "FAILED"}


def zip_folder(folder: str | os.PathLike, excludes: Sequence[str] = (), parent: bool = False) -> tuple[str, bytes]:
    """(``_ray_pkg_<hash>.zip``, its bytes) of ``folder``'s files (``.git``, ``__pycache__``
    and ``excludes`` patterns left out); the name hashes the paths and contents, so the same
    folder is uploaded once. ``parent``: entries keep the folder's own name (py_modules)."""
    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise errors.InvalidArgumentError(f"{folder} is not a folder")
    digest = hashlib.sha256()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS
                                 and not _excluded(here / d, root, excludes))
            for name in sorted(filenames):
                path = here / name
                if _excluded(path, root, excludes) or not path.is_file():
                    continue
                rel = path.relative_to(root).as_posix()
                arcname = f"{root.name}/{rel}" if parent else rel
                data = path.read_bytes()
                digest.update(arcname.encode() + b"\0" + hashlib.sha256(data).digest())
                info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | (path.stat().st_mode & 0o777)) << 16
                # Deflate (level 1: most of what it saves on code and text, fast) where a
                # sample shrinks; stored where it does not (weights, data: deflate would only
                # spend ~40 ms a MiB). Ray's client stores everything.
                sample = data[:65536]
                shrinks = len(zlib.compress(sample, 1)) < 0.9 * len(sample)
                info.compress_type = zipfile.ZIP_DEFLATED if shrinks else zipfile.ZIP_STORED
                archive.writestr(info, data, compresslevel=1 if shrinks else None)
    return f"_ray_pkg_{digest.hexdigest()[:32]}.zip", buffer.getvalue()


def _excluded(path: Path, root: Path, patterns) -> bool:
    rel = path.relative_to(root).as_posix()
    return any(fnmatch.fnmatch(rel, p.strip("/")) or fnmatch.fnmatch(path.name, p) for p in patterns)


class _Client:
    """The Jobs API at one address, with the token."""

    def __init__(self, address: str, token: str, session) -> None:
        self.base = address.rstrip("/")
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"}

    async def call(self, method: str, path: str, **kwargs):
        async with self.session.request(method, self.base + path, headers=self.headers, **kwargs) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise errors.FailedPreconditionError(
                    f"{method} {path} failed with status code {resp.status}: {body.decode(errors='replace')}")
            return json.loads(body) if body else None

    async def upload(self, folder: str, excludes, parent: bool = False) -> str:
        name, data = await asyncio.to_thread(zip_folder, folder, excludes, parent)
        async with self.session.get(f"{self.base}/api/packages/gcs/{name}", headers=self.headers) as resp:
            exists = resp.status == 200
        if not exists:
            await self.call("PUT", f"/api/packages/gcs/{name}", data=data)
        return f"gcs://{name}"

    async def follow(self, job_id: str) -> None:
        import aiohttp

        try:
            async with self.session.ws_connect(f"{self.base}/api/jobs/{job_id}/logs/tail",
                                               headers=self.headers) as ws:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        sys.stdout.write(msg.data)
                        sys.stdout.flush()
        except aiohttp.WSServerHandshakeError as exc:  # 401, 404: say which, as call() does
            await self.call("GET", f"/api/jobs/{job_id}")
            raise errors.FailedPreconditionError(f"following job {job_id} failed with status code {exc.status}")


def _runtime_env(args: argparse.Namespace) -> dict:
    env: dict = {}
    if args.runtime_env:
        text = Path(args.runtime_env).read_text()
        try:
            env = json.loads(text)
        except ValueError:
            import yaml
            try:
                env = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                raise errors.InvalidArgumentError(f"{args.runtime_env} is neither JSON nor YAML: {exc}") from None
    if args.runtime_env_json:
        env.update(json.loads(args.runtime_env_json))
    if args.working_dir:
        env["working_dir"] = args.working_dir
    if not isinstance(env, dict):
        raise errors.InvalidArgumentError("the runtime env must be a mapping")
    return env


def _read_requirements(env: dict) -> dict:
    """``env`` with a ``pip``/``uv`` requirements.txt path replaced by its lines: read here, as
    Ray's job client reads it (the scheduler does not read its own files)."""
    from podium.runtimeenv import PIP_INSTALLERS, parse_pip

    for key in PIP_INSTALLERS:
        value = env.get(key)
        if isinstance(value, str) or isinstance(value, dict) and isinstance(value.get("packages"), str):
            lines = list(parse_pip(key, value)["packages"])
            env[key] = {**value, "packages": lines} if isinstance(value, dict) else lines
    return env


async def _packaged(client: _Client, env: dict) -> dict:
    """``env`` with its local working_dir and py_modules folders uploaded (URIs instead)."""
    excludes = env.pop("excludes", None) or []
    working_dir = env.get("working_dir")
    if working_dir and "://" not in working_dir:
        env["working_dir"] = await client.upload(working_dir, excludes)
    modules = env.get("py_modules")
    if modules:
        env["py_modules"] = [m if "://" in m else await client.upload(m, excludes, parent=True) for m in modules]
    return env


async def _run(args: argparse.Namespace, address: str, token: str) -> int:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=_ssl(address))) as http:
        client = _Client(address, token, http)
        command = args.command
        if command == "submit":
            entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
            if not entrypoint:
                raise errors.InvalidArgumentError("give the entrypoint after --, e.g. -- python train.py")
            # Joined as `ray job submit` joins it.
            body = {"entrypoint": subprocess.list2cmdline(entrypoint), "submission_id": args.submission_id,
                    "runtime_env": await _packaged(client, _read_requirements(_runtime_env(args))) or None,
                    "metadata": json.loads(args.metadata_json) if args.metadata_json else None,
                    "entrypoint_num_cpus": args.entrypoint_num_cpus,
                    "entrypoint_num_gpus": args.entrypoint_num_gpus}
            reply = await client.call("POST", "/api/jobs/", json={k: v for k, v in body.items() if v is not None})
            job_id = reply["submission_id"]
            print(f"Job '{job_id}' submitted successfully")
            if args.no_wait:
                print(f"  podium job logs {job_id} --follow | podium job status {job_id} | podium job stop {job_id}")
                return 0
            await client.follow(job_id)
            return _final(await client.call("GET", f"/api/jobs/{job_id}"))
        if command == "list":
            for job in await client.call("GET", "/api/jobs/"):
                print(f"{job['submission_id']}\t{job['status']}\t{job['entrypoint']}")
            return 0
        job_id = args.job_id
        if command == "status":
            job = await client.call("GET", f"/api/jobs/{job_id}")
            print(f"Status for job '{job_id}': {job['status']}\nStatus message: {job['message']}")
            return 0
        if command == "logs":
            if args.follow:
                await client.follow(job_id)
            else:
                sys.stdout.write((await client.call("GET", f"/api/jobs/{job_id}/logs"))["logs"])
            return 0
        if command == "stop":
            if not (await client.call("POST", f"/api/jobs/{job_id}/stop"))["stopped"]:
                job = await client.call("GET", f"/api/jobs/{job_id}")
                print(f"Job '{job_id}' had already ended ({job['status']}): nothing to stop")
                return 0
            print(f"Stopping job '{job_id}'")
            while not args.no_wait:
                job = await client.call("GET", f"/api/jobs/{job_id}")
                if job["status"] in _TERMINAL:
                    return _final(job)
                await asyncio.sleep(0.5)
            return 0
        await client.call("DELETE", f"/api/jobs/{job_id}")
        print(f"Job '{job_id}' deleted")
        return 0


def _final(job: dict) -> int:
    print(f"Job '{job['submission_id']}' {job['status'].lower()}: {job['message']}")
    return 1 if job["status"] == "FAILED" else 0


def _ssl(address: str):
    if not address.startswith("https://"):
        return None
    from podium.auth import TlsConfig

    tls = TlsConfig.from_paths(os.environ.get("PODIUM_TLS_CERT"), os.environ.get("PODIUM_TLS_KEY"),
                               os.environ.get("PODIUM_TLS_CA"))
    return tls.ssl_context(server=False) if tls else None


def _target(args: argparse.Namespace) -> tuple[str, str]:
    from podium.auth import resolve_token
    from podium.cli import localcluster

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS")
    ray_address = os.environ.get("RAY_ADDRESS", "")
    if not address and ray_address.startswith(("http://", "https://")):
        address = ray_address
    if address:
        return address, resolve_token()
    cluster = localcluster.load(args.dir)
    if cluster is not None:
        return cluster.http_url, os.environ.get("PODIUM_TOKEN") or cluster.token()
    return "http://127.0.0.1:8265", resolve_token()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podium job", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None, help="the scheduler's HTTP URL, http://HOST:8265")
    common.add_argument("--dir", default=os.environ.get("PODIUM_LOCAL_DIR", "~/.podium/local"),
                        help="the `podium up` cluster to use when no address is given")
    s = sub.add_parser("submit", parents=[common], help="submit a job (and follow its logs)")
    s.add_argument("--submission-id", "--job-id", dest="submission_id", default=None)
    s.add_argument("--runtime-env", default=None, help="a runtime env YAML or JSON file")
    s.add_argument("--runtime-env-json", default=None, help="a runtime env as JSON")
    s.add_argument("--working-dir", default=None, help="local folder to upload and run in")
    s.add_argument("--metadata-json", default=None)
    s.add_argument("--entrypoint-num-cpus", type=float, default=None)
    s.add_argument("--entrypoint-num-gpus", type=float, default=None)
    s.add_argument("--no-wait", action="store_true", help="return once submitted")
    s.add_argument("entrypoint", nargs=argparse.REMAINDER, help="the command, after --")
    for name, text in (("status", "a job's status"), ("logs", "a job's output"), ("stop", "stop a job"),
                       ("delete", "forget an ended job")):
        c = sub.add_parser(name, parents=[common], help=text)
        c.add_argument("job_id")
        if name == "logs":
            c.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
        if name == "stop":
            c.add_argument("--no-wait", action="store_true", help="return without waiting for the end")
    sub.add_parser("list", parents=[common], help="every job")
    return p


def main(argv: list[str]) -> int:
    """Run ``podium job ...``; the exit status (1 for a failed job or request)."""
    import aiohttp

    args = _parser().parse_args(argv)
    try:
        address, token = _target(args)
        return asyncio.run(_run(args, address, token))
    except KeyboardInterrupt:
        return 130
    except (errors.PodiumError, OSError, ValueError, aiohttp.ClientError) as exc:
        print(f"podium job {args.command}: {exc}", file=sys.stderr)
        return 1
