"""How the agent launches a worker process: its argv and its environment."""

from __future__ import annotations

import os
import pathlib
import signal
from typing import Mapping, Sequence

from podium.auth import TlsConfig
from podium.process import die_with_parent_argv
from podium.runtimeenv import ENV_KEY, pip_fields, to_env
from podium.worker.agent.envlauncher import launcher_command, link_modules, needs_launcher
from podium.worker.agent.packages import is_uri
from podium.v1 import common_pb2

__all__ = ["ALLOCATOR_DEFAULTS", "TLS_ENV_KEYS", "NOSET_CUDA_VISIBLE_DEVICES", "ASSIGNED_GPUS",
           "launch_argv", "with_allocator_defaults", "worker_env", "foreign_command", "runtime_env_vars",
           "link_modules", "launch_plan"]

#: Ray's switch (slime and SkyRL set it): the worker sees every GPU of its node, not only its own.
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
#: The GPUs a worker was given when CUDA_VISIBLE_DEVICES no longer says (``ray.get_gpu_ids``).
ASSIGNED_GPUS = "PODIUM_ASSIGNED_GPUS"

#: Allocator settings every worker (and the fork server) gets unless the agent's environment
#: sets them. ``THP_MEM_ALLOC_ENABLE=1``: torch backs its CPU allocations of 2 MiB and more
#: with transparent huge pages (``madvise``). glibc serves each allocation over 32 MiB with a
#: fresh mapping, so a method's new 128 MiB result faulted in 32,768 pages every call: 53 ms
#: of a 128 MiB ``torch.ones`` here, against 17.5 ms with 2 MiB pages (~580 faults), and a fresh
#: result went back at 1,964 against 5,110 MB/s on one host (``python -m bench.crosshost``,
#: the ``fresh`` cell). ``THP_MEM_ALLOC_ENABLE=0`` in the agent's environment switches it off.
#: (Keeping freed memory in glibc's heap instead, ``MALLOC_MMAP_MAX_=0`` with a high trim
#: threshold, worked for ``malloc`` but not for torch's ``posix_memalign``: still one fault
#: per page.)
ALLOCATOR_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def launch_argv(command: Sequence[str], ready_fd: int) -> list[str]:
    """The argv that starts a worker: the shim (Linux) then ``command --ready-fd N``."""
    return die_with_parent_argv([*command, "--ready-fd", str(ready_fd)], signal.SIGKILL)


#: Environment variables naming a worker's mutual-TLS files (read by podium.worker.host.process).
TLS_ENV_KEYS = ("PODIUM_TLS_CERT", "PODIUM_TLS_KEY", "PODIUM_TLS_CA")


def with_allocator_defaults(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with :data:`ALLOCATOR_DEFAULTS` where it does not set them (the agent's base
    environment for its workers and fork server)."""
    return {**ALLOCATOR_DEFAULTS, **base}


def worker_env(base: Mapping[str, str], env: Mapping[str, str], *, token: str,
               scheduler: str, worker_id: str = "", node_address: str = "",
               tls: TlsConfig | None = None) -> dict[str, str]:
    """The environment of a worker process (see the module docstring).

    ``env`` (the scheduler's WorkerInfo.env) wins over ``base``; the token, the
    scheduler address, the worker id and node address are only filled in when absent.
    The TLS variables are exactly the agent's ``tls`` (none without it): a worker
    serves with the agent's security, whatever the environment says.
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless ``env`` says otherwise, so the NVML
    indices in CUDA_VISIBLE_DEVICES mean the same GPUs to CUDA.
    With ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` set (in ``env`` or ``base``), as in
    Ray, CUDA_VISIBLE_DEVICES is not narrowed to the worker's GPUs: it is what the agent
    itself has (unset: every GPU of the node), and the worker's own GPUs are in
    ``PODIUM_ASSIGNED_GPUS`` (what ``ray.get_gpu_ids()`` returns).
    """
    out = {k: v for k, v in base.items() if k != "PODIUM_TOKEN_FILE"}
    out.update(env)
    for key in TLS_ENV_KEYS:
        out.pop(key, None)
    if tls is not None:
        out.update(zip(TLS_ENV_KEYS, (tls.cert, tls.key, tls.ca)))
    defaults = {"PODIUM_TOKEN": token, "PODIUM_SCHEDULER": scheduler,
                "PODIUM_WORKER_ID": worker_id, "PODIUM_NODE_ADDRESS": node_address}
    for key, value in defaults.items():
        if value and key not in env:
            out[key] = value
    # CUDA_VISIBLE_DEVICES carries NVML indices, which follow PCI bus order;
    # CUDA's default order (fastest first) may differ on mixed machines.
    if "CUDA_DEVICE_ORDER" not in env:
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if out.get(NOSET_CUDA_VISIBLE_DEVICES):  # any non-empty value, as Ray reads it
        out[ASSIGNED_GPUS] = out.get("CUDA_VISIBLE_DEVICES", "")
        if "CUDA_VISIBLE_DEVICES" in base:
            out["CUDA_VISIBLE_DEVICES"] = base["CUDA_VISIBLE_DEVICES"]
        else:
            out.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        out.pop(ASSIGNED_GPUS, None)
    out["PYTHONUNBUFFERED"] = "1"
    return out


#: How a worker with its own interpreter (runtime_env.py_executable) starts: this program, run
#: by ``python -c`` in that interpreter, says plainly when Podium's worker host does not import
#: there, naming the interpreter, instead of a bare ``No module named 'podium'``.
_FOREIGN_HOST = """import sys
try:
    from podium.worker.host import process
except ImportError as exc:
    sys.stderr.write("podium: Podium's worker host (podium.worker.host) does not import in the "
                     "interpreter %s, started by %s: %s: install podium "
                     "(the cluster's version) in that environment\\n" % (sys.executable, COMMAND, exc))
    sys.exit(1)
sys.exit(process.main(sys.argv[1:]))
"""


def foreign_command(python_command: Sequence[str], label: str = "") -> tuple[str, ...]:
    """The worker command (``--ready-fd N`` is appended) for a worker started by the
    interpreter command ``python_command`` (its last word is the interpreter); ``label`` names
    the interpreter in the error when it is not that command (a pip virtualenv)."""
    code = _FOREIGN_HOST.replace("COMMAND", repr(label or f"runtime_env py_executable {' '.join(python_command)}"))
    return (*python_command, "-c", code)


def launch_plan(spec: common_pb2.WorkerSpec, env: dict[str, str], default: Sequence[str],
                state_dir: pathlib.Path) -> tuple[tuple[str, ...], str]:
    """The command (``--ready-fd N`` is appended) and cwd that start a worker with ``spec``'s
    runtime environment, with ``env`` completed for it: ``default`` (the agent's command) or its
    py_executable, in its working_dir with its py_modules on ``PYTHONPATH``. A ``pip`` set or a
    package URI puts the launcher in front (podium.worker.agent.envlauncher), which sets those
    up on this node and then execs the same foreign host a py_executable runs.
    FileNotFoundError when a local working_dir or py_module is not on this node."""
    pip = pip_fields(spec)
    if needs_launcher(pip, spec.working_dir, spec.py_modules):
        inner = (foreign_command((), "a pip virtualenv") if pip
                 else foreign_command(spec.python_command) if spec.python_command else tuple(default))
        return (*launcher_command(state_dir, pip, spec.working_dir, spec.py_modules), *inner), os.getcwd()
    if spec.working_dir and not os.path.isdir(spec.working_dir):
        raise FileNotFoundError(f"runtime_env working_dir {spec.working_dir!r} is not a directory on this node")
    modules = link_modules(state_dir / "py_modules", tuple(spec.py_modules))
    env.update(runtime_env_vars(env, spec, modules))
    command = foreign_command(spec.python_command) if spec.python_command else tuple(default)
    return command, spec.working_dir or os.getcwd()


def runtime_env_vars(base: Mapping[str, str], spec: common_pb2.WorkerSpec, modules_dir: str) -> dict[str, str]:
    """Variables of a worker with ``spec``'s runtime environment (podium.runtimeenv): its
    working_dir and its py_modules folder (``modules_dir``) first on ``PYTHONPATH`` (Ray puts
    both on sys.path), and the runtime environment its own actors and tasks inherit
    (``PODIUM_RUNTIME_ENV``; empty for a worker without one)."""
    out: dict[str, str] = {}
    front = [p for p in (spec.working_dir, modules_dir) if p and not is_uri(p)]  # URIs: the launcher
    if front:
        out["PYTHONPATH"] = os.pathsep.join([*front, *filter(None, [base.get("PYTHONPATH", "")])])
    out[ENV_KEY] = to_env(tuple(spec.python_command), spec.working_dir, tuple(spec.py_modules), pip_fields(spec))
    return out
