"""Ray's log monitor over Podium's worker logs: ``ray._private.log_monitor`` and the printing
half of ``ray._private.worker`` (``print_to_stdstream``, ``print_worker_logs``).

ROLL's launcher (``roll/distributed/scheduler/log_monitor.py``) subclasses Ray's
``LogMonitor``: when it started the cluster itself (``ray start``), each of its drivers tails
the worker logs of its node in a thread, prints them and copies each actor's output to
``./output/logs/<actor>.log``. It overrides only ``update_log_filenames`` (which files to
follow: ``<logs_dir>/worker*[.out|.err]``, the pid read with ``WORKER_LOG_PATTERN``) and uses
the rest of Ray's loop, its ``LogFileInfo`` and its publisher interface (``publish_logs(data)``).

Ray's raylet writes each worker's output to ``<session>/logs/worker-<id>-<job>-<pid>.out|.err``.
Podium's node agent writes it to ``<agent log dir>/<worker id>.out|.err`` instead, so before
each look for new files this monitor lists the Podium workers of its node (``node_ip_address``,
from the scheduler's cluster state) in ``logs_dir`` under Ray's names, as symbolic links to the
agent's files (``worker-<worker id>-<owner crc32>-<pid>.out|.err``), then runs Ray's loop
unchanged over ``logs_dir``. Where a line of Ray's worker names its actor (``:actor_name:``,
the actor's ``repr``), Podium's log header (``### podium worker ...``, written at each start)
names it here: the actor's name for a named actor, its class for an unnamed one, the worker's
name for a worker-group rank. ``ray.nodes()[i]["ObjectStoreSocketName"]`` is
``<PODIUM_RAY_DIR>/session_latest/sockets/plasma_store`` on every node, as Ray's
``session_latest``, so ``<that>/../../logs`` is :func:`session_logs_dir`.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import sys
import threading
import time
import zlib
from typing import Any, Callable

from podium.errors import InvalidArgumentError
from podium.private import given_dir, private_dir

__all__ = [
    "LOG_NAME_UPDATE_INTERVAL_S", "LogFileInfo", "LogMonitor", "RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED",
    "RUNTIME_ENV_SETUP_PATTERN", "WORKER_LOG_PATTERN", "is_proc_alive", "object_store_socket_name",
    "print_to_stdstream", "print_worker_logs", "session_logs_dir",
]

logger = logging.getLogger(__name__)

#: Ray's pattern of a worker log's name; the groups are the job id and the pid.
WORKER_LOG_PATTERN = re.compile(r".*worker.*-([0-9a-f]+)-(\d+)")
#: Ray's pattern of a runtime_env setup log (Podium writes none).
RUNTIME_ENV_SETUP_PATTERN = re.compile(r".*runtime_env_setup-(\d+).log")
#: Ray's interval between two looks for new files once there are many.
LOG_NAME_UPDATE_INTERVAL_S = float(os.getenv("LOG_NAME_UPDATE_INTERVAL_S", "0.5"))
#: Ray's count of files above which new files are looked for only every interval.
RAY_LOG_MONITOR_MANY_FILES_THRESHOLD = int(os.getenv("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "1000"))
#: Ray's switch for runtime_env setup logs (Podium writes none: nothing matches them).
RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED = int(os.getenv("RAY_RUNTIME_ENV_LOG_TO_DRIVER_ENABLED", "0"))
#: Ray's bounds: files open at once, lines read from one file per pass.
MAX_OPEN_FILES = int(os.getenv("RAY_LOG_MONITOR_MAX_OPEN_FILES", "200"))
LINES_PER_PASS = int(os.getenv("RAY_LOG_MONITOR_NUM_LINES_TO_READ", "1000"))
#: The scheduler is asked for this node's workers at most this often (Ray's loop turns every 0.1 s).
LIST_INTERVAL_S = 1.0
#: Ray's markers in a worker's output, and Podium's log header (worker/agent/exitinfo.py).
ACTOR_NAME, TASK_NAME, JOB_ID = ":actor_name:", ":task_name:", ":job_id:"
PODIUM_HEADER = "### podium worker "
_ACTOR_PREFIX = "actor:"  # podium.controller.remote.actors names an actor's worker with it


def session_logs_dir() -> str:
    """Where the monitor lists this node's worker logs: ``$PODIUM_RAY_DIR/session_latest/logs``
    (``~/.podium/ray`` by default, the folder of Podium's ``ray start``)."""
    root = os.environ.get("PODIUM_RAY_DIR") or os.path.expanduser("~/.podium/ray")
    return os.path.join(root, "session_latest", "logs")


def object_store_socket_name() -> str:
    """``ray.nodes()``'s ``ObjectStoreSocketName``: Podium has no plasma store; the path is the
    one Ray's would have in the session folder whose ``logs`` is :func:`session_logs_dir`
    (ROLL finds its logs folder as ``dirname(dirname(ObjectStoreSocketName))/logs``)."""
    return os.path.join(os.path.dirname(session_logs_dir()), "sockets", "plasma_store")


def is_proc_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


class LogFileInfo:
    """One followed file: where it was read up to, its open handle, and whose it is (Ray's)."""

    def __init__(self, filename: str | None = None, size_when_last_opened: int | None = None,
                 file_position: int | None = None, file_handle: Any = None, is_err_file: bool = False,
                 job_id: str | None = None, worker_pid: Any = None) -> None:
        if filename is None or size_when_last_opened is None or file_position is None:
            raise InvalidArgumentError("LogFileInfo needs filename, size_when_last_opened and file_position")
        self.filename = filename
        self.size_when_last_opened = size_when_last_opened
        self.file_position = file_position
        self.file_handle = file_handle
        self.is_err_file = is_err_file
        self.job_id = job_id
        self.worker_pid = worker_pid
        self.actor_name: str | None = None
        self.task_name: str | None = None

    def reopen_if_necessary(self) -> None:
        """Reopen the file when its inode changed (rotated) or it shrank (rewritten in place)."""
        try:
            open_inode = os.fstat(self.file_handle.fileno()).st_ino if self.file_handle and \
                not self.file_handle.closed else None
            stat = os.stat(self.filename)
            if stat.st_ino != open_inode:
                self.file_handle = open(self.filename, "rb")
                if stat.st_size < self.file_position:
                    self.file_position = 0
                self.file_handle.seek(self.file_position)
                self.size_when_last_opened = stat.st_size
            elif stat.st_size < max(self.file_position, self.size_when_last_opened):
                self.file_handle.close()
                self.file_handle = open(self.filename, "rb")
                self.file_position = 0
                self.size_when_last_opened = stat.st_size
        except OSError:
            logger.debug("file %s no longer exists; not reopened", self.filename)

    def __repr__(self) -> str:
        return (f"LogFileInfo(filename={self.filename!r}, file_position={self.file_position}, "
                f"is_err_file={self.is_err_file}, worker_pid={self.worker_pid}, actor_name={self.actor_name!r})")


def actor_label(worker_name: str) -> str:
    """What Podium's header names a worker as, in place of Ray's ``:actor_name:``: a named
    actor's name (``actor:<namespace>:<name>``), an unnamed actor's class
    (``actor:<Class>-<hex>``), else the worker's name."""
    if not worker_name.startswith(_ACTOR_PREFIX):
        return worker_name
    rest = worker_name[len(_ACTOR_PREFIX):]
    parts = rest.split(":", 1)
    if len(parts) == 2:
        return parts[1]
    return rest.rsplit("-", 1)[0]


class LogMonitor:
    """Ray's log monitor, over ``logs_dir`` where it first lists this node's Podium worker logs.

    ``run()`` loops as Ray's does: list new files (:meth:`update_log_filenames`, which ROLL
    overrides), open those that grew (at most ``max_files_open`` at once), read up to 1,000 new
    lines from each and hand them to ``gcs_client.publish_logs(data)`` (``ip``, ``pid``,
    ``job``, ``is_err``, ``lines``, ``actor_name``, ``task_name``). ``gcs_publisher`` is the
    name Ray before 2.47 gave ``gcs_client``. A dead worker's files move to ``logs_dir/old``.
    """

    def __init__(self, node_ip_address: str, logs_dir: str, gcs_client: Any = None,
                 is_proc_alive_fn: Callable[[int], bool] = is_proc_alive, max_files_open: int = MAX_OPEN_FILES,
                 gcs_address: str | None = None, gcs_publisher: Any = None) -> None:
        publisher = gcs_client if gcs_client is not None else gcs_publisher
        if publisher is None or not callable(getattr(publisher, "publish_logs", None)):
            raise InvalidArgumentError("LogMonitor needs gcs_client (or gcs_publisher) with a publish_logs(data) method")
        if not 1 <= max_files_open <= 65536:
            raise InvalidArgumentError(f"max_files_open must be in [1, 65536], not {max_files_open}")
        self.ip = node_ip_address
        self.logs_dir = logs_dir
        self.gcs_client = publisher
        self.log_filenames: set[str] = set()
        self.open_file_infos: list[LogFileInfo] = []
        self.closed_file_infos: list[LogFileInfo] = []
        self.can_open_more_files = True
        self.max_files_open = max_files_open
        self.is_proc_alive_fn = is_proc_alive_fn
        self.is_autoscaler_v2 = False  # Podium has no autoscaler: no monitor.log or events
        self._labels: dict[str, str] = {}  # link path -> the worker's label
        self._listed: set[tuple[str, int]] = set()  # (worker id, pid) already linked
        self._last_listed = 0.0
        self._stop = threading.Event()
        # Links go into this folder and the files they name are read and printed: refused
        # where another local user could plant links there.
        given_dir(logs_dir, "LogMonitor's logs_dir")
        private_dir(os.path.join(logs_dir, "old"))
        self._forget_stale_links()

    # ---- Podium's part: this node's worker logs, under Ray's names --------------------------

    def _forget_stale_links(self) -> None:
        """Links a previous monitor left in ``logs_dir`` point at workers of another session:
        the links go (the agents' files stay), so old output is not printed again."""
        for path in glob.glob(os.path.join(self.logs_dir, "worker-*")):
            if os.path.islink(path):
                os.unlink(path)

    def list_podium_worker_logs(self) -> int:
        """Link the logs of this node's workers that are not linked yet into ``logs_dir``;
        returns how many were linked. Without a Podium session (not initialized, shut down) or
        a scheduler that answers, nothing is linked this time."""
        from podium.controller.session import runtime as _runtime

        if not _runtime.is_initialized():
            return 0
        try:
            rt = _runtime.get_runtime(auto_init=False)
            state = rt.run(rt.cluster_state(), timeout=10, what="listing worker logs")
        except Exception as exc:  # noqa: BLE001 - a monitor thread outlives a session; say it and go on
            logger.debug("worker logs not listed: %s", exc)
            return 0
        linked = 0
        for worker in state.workers:
            key = (worker.id, worker.pid)
            if worker.node_address != self.ip or worker.pid <= 0 or not worker.log_path or key in self._listed:
                continue
            out = worker.log_path
            err = out[:-len(".out")] + ".err" if out.endswith(".out") else ""
            job = format(zlib.crc32(worker.owner.encode()), "08x")
            for target, suffix in ((out, "out"), (err, "err")):
                if not target or not os.path.isfile(target):
                    continue
                link = os.path.join(self.logs_dir, f"worker-{worker.id}-{job}-{worker.pid}.{suffix}")
                try:
                    os.symlink(target, link)
                except FileExistsError:
                    pass
                self._labels[link] = actor_label(worker.spec.name or worker.id)
                linked += 1
            self._listed.add(key)
        return linked

    # ---- Ray's loop ---------------------------------------------------------------------------

    def _close_all_files(self) -> None:
        """Close every open file; a dead worker's file moves to ``logs_dir/old``."""
        while self.open_file_infos:
            info = self.open_file_infos.pop(0)
            info.file_handle.close()
            info.file_handle = None
            alive = True
            if isinstance(info.worker_pid, int):
                alive = self.is_proc_alive_fn(info.worker_pid)
                if not alive:
                    try:
                        shutil.move(info.filename, os.path.join(self.logs_dir, "old",
                                                                os.path.basename(info.filename)))
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            raise
            if alive:
                self.closed_file_infos.append(info)
        self.can_open_more_files = True

    def update_log_filenames(self) -> None:
        """Follow the ``worker*.out``/``worker*.err`` files of ``logs_dir`` not followed yet."""
        for path in glob.glob(f"{self.logs_dir}/worker*[.out|.err]"):
            if os.path.isfile(path) and path not in self.log_filenames:
                match = WORKER_LOG_PATTERN.match(path)
                self.log_filenames.add(path)
                self.closed_file_infos.append(LogFileInfo(
                    filename=path, size_when_last_opened=0, file_position=0, file_handle=None,
                    is_err_file=path.endswith("err"), job_id=None,
                    worker_pid=int(match.group(2)) if match else None))

    def open_closed_files(self) -> None:
        """Open closed files that grew, as many as ``max_files_open`` allows."""
        if not self.can_open_more_files:
            self._close_all_files()
        unchanged = []
        while self.closed_file_infos:
            if len(self.open_file_infos) >= self.max_files_open:
                self.can_open_more_files = False
                break
            info = self.closed_file_infos.pop(0)
            try:
                size = os.path.getsize(info.filename)
                if size > info.size_when_last_opened:
                    handle = open(info.filename, "rb")
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                self.log_filenames.discard(info.filename)
                continue
            if size > info.size_when_last_opened:
                handle.seek(info.file_position)
                info.size_when_last_opened = size
                info.file_handle = handle
                self.open_file_infos.append(info)
            else:
                unchanged.append(info)
        if len(self.open_file_infos) >= self.max_files_open:
            self.can_open_more_files = False
        self.closed_file_infos += unchanged

    def check_log_files_and_publish_updates(self) -> bool:
        """Read the new lines of every open file and publish them; True if any were."""
        published = False
        for info in self.open_file_infos:
            info.reopen_if_necessary()
            lines: list[str] = []

            def flush() -> None:
                nonlocal lines, published
                if lines:
                    data = {"ip": self.ip, "pid": info.worker_pid, "job": info.job_id, "is_err": info.is_err_file,
                            "lines": lines, "actor_name": info.actor_name, "task_name": info.task_name}
                    try:
                        self.gcs_client.publish_logs(data)
                    except Exception:  # noqa: BLE001 - as Ray: one bad publish does not stop the monitor
                        logger.exception("publishing %d log lines failed", len(lines))
                    published = True
                    lines = []

            for _ in range(LINES_PER_PASS):
                line = info.file_handle.readline().decode("utf-8", "replace")
                if line == "":
                    break
                line = line.rstrip("\r\n")
                if line.startswith(PODIUM_HEADER):  # a (re)start of the worker: its name follows
                    flush()
                    info.actor_name, info.task_name = self._labels.get(info.filename), None
                elif line.startswith(ACTOR_NAME):
                    flush()
                    info.actor_name, info.task_name = line[len(ACTOR_NAME):], None
                elif line.startswith(TASK_NAME):
                    flush()
                    info.task_name = line[len(TASK_NAME):]
                elif line.startswith(JOB_ID):
                    info.job_id = line[len(JOB_ID):]
                else:
                    lines.append(line)
            info.file_position = info.file_handle.tell()
            flush()
        return published

    def should_update_filenames(self, last_file_updated_time: float) -> bool:
        """Ray's back-pressure: with many files, look for new ones only every interval."""
        return (len(self.log_filenames) < RAY_LOG_MONITOR_MANY_FILES_THRESHOLD
                or time.time() - last_file_updated_time > LOG_NAME_UPDATE_INTERVAL_S)

    def run(self) -> None:
        """Follow and publish until :meth:`stop` (Ray's runs until its process ends; ROLL runs
        it in a daemon thread)."""
        last_updated = time.time()
        while not self._stop.is_set():
            if time.monotonic() - self._last_listed >= LIST_INTERVAL_S:
                self._last_listed = time.monotonic()
                self.list_podium_worker_logs()
            if self.should_update_filenames(last_updated):
                self.update_log_filenames()
                last_updated = time.time()
            self.open_closed_files()
            if not self.check_log_files_and_publish_updates():
                self._stop.wait(0.1)

    def stop(self) -> None:
        """End :meth:`run` after its current pass (Podium's addition; Ray's has no stop)."""
        self._stop.set()


def print_worker_logs(data: dict, print_file: Any, ignore_prefix: bool = False) -> None:
    """Print a published batch as Ray's driver does: ``(<actor> pid=<pid>, ip=<ip>) <line>``
    (no colours)."""
    name = data.get("actor_name") or data.get("task_name")
    prefix = f"{name} pid=" if name else "pid="
    ip = data.get("ip")
    ip_part = "" if ip == data.get("localhost") else f", ip={ip}"
    for line in data.get("lines", []):
        print(line if ignore_prefix else f"({prefix}{data.get('pid')}{ip_part}) {line}", file=print_file)
    if hasattr(print_file, "flush"):
        print_file.flush()


def print_to_stdstream(data: dict, ignore_prefix: bool = False) -> None:
    """Print a published batch to this process's stderr (``is_err``) or stdout."""
    print_worker_logs(data, sys.stderr if data.get("is_err") else sys.stdout, ignore_prefix)
