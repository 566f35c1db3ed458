"""Submitted jobs as records: Ray's statuses and fields, the submit request's checks, the bounds.

A job is a driver program submitted over HTTP (``POST /api/jobs/``, :mod:`podium.scheduler.jobshttp`)
and run by the scheduler (:mod:`podium.scheduler.jobs`). Its record has the fields of Ray's
``JobInfo``/``JobDetails`` (``ray.dashboard.modules.job.common`` and ``pydantic_models`` of Ray
2.60), so the real ``ray job`` CLI and ``JobSubmissionClient`` read it unchanged; times are
Unix milliseconds, as Ray's are.
"""

from __future__ import annotations

import math
import re
import secrets
import string
from dataclasses import asdict, dataclass, field

from podium.errors import InvalidArgumentError
from podium.runtimeenv import (PIP_INSTALLERS, SETUP_FAILED_EXIT, SETUP_FAILED_LINE, PipFields, parse_pip,
                               parse_py_executable)

__all__ = ["PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED", "TERMINAL", "JobRecord",
           "SubmitRequest", "parse_submit", "new_submission_id", "MAX_LIVE_JOBS", "MAX_JOB_RECORDS",
           "MAX_ENTRYPOINT_CHARS", "MAX_METADATA_ITEMS", "MAX_ENV_VARS", "MAX_TEXT_CHARS",
           "SUPERVISOR_DIED", "ENTRYPOINT_ERROR", "START_ERROR", "RUNTIME_ENV_FAILURE", "pip_of",
           "failure_of", "MESSAGE_TAIL"]

PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED = "PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"
#: Statuses a job never leaves (Ray's ``JobStatus.is_terminal``).
TERMINAL = frozenset({STOPPED, SUCCEEDED, FAILED})
#: Ray's ``JobErrorType`` values Podium reports.
SUPERVISOR_DIED = "JOB_SUPERVISOR_ACTOR_DIED"
ENTRYPOINT_ERROR = "JOB_ENTRYPOINT_COMMAND_ERROR"
START_ERROR = "JOB_ENTRYPOINT_COMMAND_START_ERROR"
RUNTIME_ENV_FAILURE = "RUNTIME_ENV_SETUP_FAILURE"

#: Jobs PENDING or RUNNING at once, at most (each is a driver process on the scheduler's machine).
MAX_LIVE_JOBS = 64
#: Job records kept; beyond it the oldest ended ones go, with their logs (so at most this
#: many logs of joblog.MAX_LOG_BYTES each are on disk).
MAX_JOB_RECORDS = 256
MAX_ENTRYPOINT_CHARS = 64 * 1024
MAX_METADATA_ITEMS = 64
MAX_ENV_VARS = 256
#: Longest metadata key or value, env variable name or value, package URI.
MAX_TEXT_CHARS = 16 * 1024
#: Characters of the log's end a FAILED job's message quotes (Ray quotes 20,000).
MESSAGE_TAIL = 20_000
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
#: The runtime_env fields a job may set; anything else is refused, naming what to do instead.
#: ``_ray_commit`` is what Ray's client adds beside a pip/uv set (the Ray version to pin there; the
#: virtualenv sees Podium's stand-in instead): accepted with no effect.
_RUNTIME_ENV_FIELDS = frozenset({"working_dir", "py_modules", "env_vars", "excludes", "config", "py_executable",
                                 *PIP_INSTALLERS, "_ray_commit"})
_REFUSED_RUNTIME_ENV = ("conda", "container", "image_uri", "java_jars", "nsight",
                        "worker_process_setup_hook", "mpi", "rocprof_sys", "_nsight")


def new_submission_id() -> str:
    """A fresh id in Ray's form: ``raysubmit_`` and 16 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "raysubmit_" + "".join(secrets.choice(alphabet) for _ in range(16))


@dataclass
class JobRecord:
    """One submitted job, as kept in the state file (JSON) and served (:meth:`details`)."""

    submission_id: str
    entrypoint: str
    status: str = PENDING
    message: str | None = None
    error_type: str | None = None
    start_time: int | None = None
    end_time: int | None = None
    metadata: dict[str, str] | None = None
    runtime_env: dict | None = None
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None
    entrypoint_memory: int | None = None
    entrypoint_resources: dict[str, float] | None = None
    driver_exit_code: int | None = None
    #: Podium's own: the driver's process (its group id too) and its start time in
    #: /proc ticks, so a restarted scheduler kills that process and not a recycled pid.
    pid: int = 0
    pid_start: int = 0
    node_id: str = ""
    node_address: str = ""
    #: The placement group holding a driver placed on the cluster (podium.scheduler.jobnodes);
    #: "" for one run on the scheduler's machine.
    driver_group: str = ""
    #: A stop was asked for while the job ran (it ends STOPPED whatever its exit status).
    stop_requested: bool = False

    def __post_init__(self) -> None:
        if self.message is None:
            self.message = _DEFAULT_MESSAGES.get(self.status)

    @property
    def terminal(self) -> bool:
        """True once the job ended (STOPPED, SUCCEEDED or FAILED)."""
        return self.status in TERMINAL

    def to_json(self) -> dict:
        """Every field (the state file's form)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "JobRecord":
        """A record from :meth:`to_json` (fields of a newer version are dropped)."""
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def details(self) -> dict:
        """Ray's ``JobDetails`` of this job (a SUBMISSION job)."""
        return {
            "type": "SUBMISSION", "job_id": self.submission_id, "submission_id": self.submission_id,
            "driver_info": ({"id": self.submission_id, "node_ip_address": self.node_address,
                             "pid": str(self.pid)} if self.pid else None),
            "status": self.status, "entrypoint": self.entrypoint, "message": self.message,
            "error_type": self.error_type, "start_time": self.start_time, "end_time": self.end_time,
            "metadata": self.metadata, "runtime_env": self.runtime_env,
            "entrypoint_num_cpus": self.entrypoint_num_cpus,
            "entrypoint_num_gpus": self.entrypoint_num_gpus,
            "entrypoint_memory": self.entrypoint_memory,
            "entrypoint_resources": self.entrypoint_resources,
            "driver_agent_http_address": None, "driver_node_id": self.node_id or None,
            "driver_exit_code": self.driver_exit_code,
        }


#: Ray's messages for a status without one of its own (``JobInfo.__post_init__``).
_DEFAULT_MESSAGES = {
    PENDING: "Job has not started yet.",
    RUNNING: "Job is currently running.",
    STOPPED: "Job was intentionally stopped.",
    SUCCEEDED: "Job finished successfully.",
    FAILED: "Job failed.",
}


@dataclass
class SubmitRequest:
    """A checked ``POST /api/jobs/`` body (Ray's ``JobSubmitRequest``)."""

    entrypoint: str
    submission_id: str | None = None
    runtime_env: dict = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None
    entrypoint_memory: int | None = None
    entrypoint_resources: dict[str, float] | None = None


def _text(value, what: str, limit: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise InvalidArgumentError(f"{what} is {len(value)} characters; at most {limit}")
    return value


def _number(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _str_dict(value, what: str, limit: int) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} must be a dict, got {type(value).__name__}")
    if len(value) > limit:
        raise InvalidArgumentError(f"{what} has {len(value)} entries; at most {limit}")
    return {_text(k, f"{what} key"): _text(v, f"{what}[{k!r}]") for k, v in value.items()}


def _runtime_env(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"runtime_env must be a dict, got {type(value).__name__}")
    refused = sorted(k for k in value if k in _REFUSED_RUNTIME_ENV and value[k])
    if refused:
        raise InvalidArgumentError(
            f"runtime_env {', '.join(refused)} is not supported by Podium: the driver runs in its "
            f"node's Python environment; install packages with runtime_env pip or uv (a virtualenv "
            f"per set on the driver's node, inherited by its actors), into the cluster's image, or into "
            f"a virtualenv given as runtime_env py_executable, and ship your own code with "
            f"working_dir or py_modules")
    unknown = sorted(k for k in value if k not in _RUNTIME_ENV_FIELDS and k not in _REFUSED_RUNTIME_ENV)
    if unknown:
        raise InvalidArgumentError(f"runtime_env field(s) {', '.join(map(repr, unknown))} are not known; "
                                   f"Podium takes {', '.join(sorted(_RUNTIME_ENV_FIELDS))}")
    env = {k: v for k, v in value.items() if k in _RUNTIME_ENV_FIELDS}
    if env.get("working_dir") is not None:
        _text(env["working_dir"], "runtime_env.working_dir")
    modules = env.get("py_modules")
    if modules is not None:
        if not isinstance(modules, list) or len(modules) > MAX_METADATA_ITEMS:
            raise InvalidArgumentError(f"runtime_env.py_modules must be a list of at most "
                                       f"{MAX_METADATA_ITEMS} package URIs")
        for uri in modules:
            _text(uri, "runtime_env.py_modules entry")
    if env.get("py_executable") is not None:  # the driver's actors and tasks start under it
        parse_py_executable(env["py_executable"])
    pip_of(env)
    env["env_vars"] = _str_dict(env.get("env_vars"), "runtime_env.env_vars", MAX_ENV_VARS)
    if not env["env_vars"]:
        del env["env_vars"]
    return env


def pip_of(runtime_env: dict | None) -> PipFields | None:
    """The ``pip``/``uv`` set of a job's runtime_env (None without one); InvalidArgumentError for
    one out of bounds, a requirements.txt path (its client reads it: ``ray job submit`` and
    ``podium job submit`` send its lines), both keys, or one with ``py_executable``."""
    env = runtime_env or {}
    given = [k for k in PIP_INSTALLERS if env.get(k)]
    if not given:
        return None
    named = given + (["py_executable"] if env.get("py_executable") else [])
    if len(named) > 1:
        raise InvalidArgumentError(f"runtime_env sets {' and '.join(named)}: give one (the driver runs in "
                                   f"the virtualenv Podium makes or by the given interpreter, not both)")
    value = env[given[0]]
    if isinstance(value, str) or isinstance(value, dict) and isinstance(value.get("packages"), str):
        raise InvalidArgumentError(f"runtime_env.{given[0]} names a requirements file ({str(value)[:200]!r}), "
                                   f"which the scheduler does not read: give its lines as a list (the ray and "
                                   f"podium job clients read a local file and send them)")
    return parse_pip(given[0], value)


def failure_of(job: JobRecord, code: int, tail: str) -> tuple[str, str]:
    """Ray's error type and message of a job whose driver exited with ``code`` != 0, ``tail``
    the end of its log: a runtime_env setup that failed (the launcher's exit status and line,
    podium.runtimeenv.SETUP_FAILED_EXIT) or the entrypoint's failure."""
    if code == SETUP_FAILED_EXIT and pip_of(job.runtime_env) and SETUP_FAILED_LINE in tail:
        return RUNTIME_ENV_FAILURE, f"runtime_env setup failed, last available logs:\n{tail}"
    return ENTRYPOINT_ERROR, (f"Job entrypoint command failed with exit code {code}, last available logs "
                              f"(truncated to {MESSAGE_TAIL} chars):\n{tail}")


def parse_submit(doc) -> SubmitRequest:
    """Check a submit body (keys with the value None are absent, as Ray's server has it);
    InvalidArgumentError (HTTP 400) names the first problem."""
    if not isinstance(doc, dict):
        raise InvalidArgumentError("the request body must be a JSON object")
    doc = {k: v for k, v in doc.items() if v is not None}
    known = {"entrypoint", "submission_id", "job_id", "runtime_env", "metadata", "entrypoint_num_cpus",
             "entrypoint_num_gpus", "entrypoint_memory", "entrypoint_resources",
             "entrypoint_label_selector"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise InvalidArgumentError(f"unexpected field(s) {', '.join(unknown)} in the job submission")
    if "entrypoint" not in doc:
        raise InvalidArgumentError("missing field entrypoint (the command to run)")
    entrypoint = _text(doc["entrypoint"], "entrypoint", MAX_ENTRYPOINT_CHARS)
    if not entrypoint.strip():
        raise InvalidArgumentError("entrypoint is empty: give the command to run, e.g. 'python script.py'")
    submission_id = doc.get("submission_id", doc.get("job_id"))
    if submission_id is not None:
        _text(submission_id, "submission_id")
        if not _ID.match(submission_id):
            raise InvalidArgumentError(
                f"submission_id {submission_id!r} must be 1-128 letters, digits, '_', '.' or '-' "
                f"(starting with a letter or digit)")
    if doc.get("entrypoint_label_selector"):
        raise InvalidArgumentError("entrypoint_label_selector is not supported: ask for the node with "
                                   "entrypoint_resources={'node:<node id or address>': 1}")
    gpus = _number(doc.get("entrypoint_num_gpus"), "entrypoint_num_gpus")
    memory = doc.get("entrypoint_memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 0):
        raise InvalidArgumentError(f"entrypoint_memory must be an integer >= 0, got {memory!r}")
    resources = doc.get("entrypoint_resources")
    if resources is not None and not isinstance(resources, dict):
        raise InvalidArgumentError("entrypoint_resources must be a dict of numbers")
    for name, value in (resources or {}).items():
        _text(name, "entrypoint_resources key")
        _number(value, f"entrypoint_resources[{name!r}]")
    if memory:
        raise InvalidArgumentError(
            "entrypoint_memory is not supported: Podium schedules CPUs, GPUs and resources, not "
            "memory; ask for entrypoint_num_cpus / entrypoint_num_gpus, or a node by "
            "entrypoint_resources={'node:<node id or address>': 1}")
    return SubmitRequest(
        entrypoint=entrypoint, submission_id=submission_id, runtime_env=_runtime_env(doc.get("runtime_env")),
        metadata=_str_dict(doc.get("metadata"), "metadata", MAX_METADATA_ITEMS),
        entrypoint_num_cpus=_number(doc.get("entrypoint_num_cpus"), "entrypoint_num_cpus"),
        entrypoint_num_gpus=gpus, entrypoint_memory=memory, entrypoint_resources=resources or None)
