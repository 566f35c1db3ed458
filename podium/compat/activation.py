"""Make ``import ray`` resolve to Podium's stand-in (``podium/compat/raypath/ray``).

``podium run -- COMMAND`` does this for COMMAND; for a notebook, or for code that calls
``ray.init`` itself, call it before the first ``import ray``::

    import podium.compat
    podium.compat.activate()          # or activate(address="host:port", num_cpus=8)
    import ray                        # Podium's stand-in
    ray.init()                        # the embedded cluster (or PODIUM_ADDRESS's)

It puts the stand-in's folder first on ``sys.path`` and on ``PYTHONPATH`` (so every worker,
task and actor process Podium starts for this program imports the stand-in too: workers
inherit the environment, and the stand-in's ``remote`` passes ``PYTHONPATH`` on to workers
on other nodes). It imports nothing heavy, so ``podium run`` starts fast.
"""

from __future__ import annotations

import os
import pathlib
import sys

from podium.compat.nativeverl import NATIVE_ENV, install

__all__ = ["RAYBIN", "RAYPATH", "activate", "activated_env"]

#: The folder that holds the stand-in package ``ray``; first on the path, ``import ray`` finds it.
RAYPATH = str(pathlib.Path(__file__).resolve().parent / "raypath")
#: The folder of the ``ray`` command (:mod:`podium.compat.raycli`); first on ``PATH`` under ``podium run``.
RAYBIN = str(pathlib.Path(__file__).resolve().parent / "raybin")


def activated_env(env: dict[str, str], *, address: str | None = None, num_cpus: float | None = None,
                  num_gpus: int | None = None, native_verl: bool = False) -> dict[str, str]:
    """A copy of ``env`` in which ``import ray`` is Podium's stand-in; ``address`` becomes
    ``PODIUM_ADDRESS``; the ``ray`` command (:mod:`podium.compat.raycli`) is first on ``PATH``;
    ``num_cpus``/``num_gpus`` size the embedded cluster the first
    ``ray.init()`` starts (``PODIUM_RAY_NUM_CPUS``/``PODIUM_RAY_NUM_GPUS``); ``native_verl``
    makes ``verl.single_controller.ray`` Podium's own SDK (:mod:`podium.compat.nativeverl`)."""
    out = dict(env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != RAYPATH]
    out["PYTHONPATH"] = os.pathsep.join([RAYPATH, *parts])
    # `ray start/status/stop` (ROLL's launcher shells out to them) run Podium's ray command
    # in this interpreter.
    path = [p for p in out.get("PATH", os.defpath).split(os.pathsep) if p and p != RAYBIN]
    out["PATH"] = os.pathsep.join([RAYBIN, *path])
    out["PODIUM_PYTHON"] = sys.executable
    if address:
        out["PODIUM_ADDRESS"] = address
    if num_cpus is not None:
        out["PODIUM_RAY_NUM_CPUS"] = str(num_cpus)
    if num_gpus is not None:
        out["PODIUM_RAY_NUM_GPUS"] = str(int(num_gpus))
    if native_verl:
        out[NATIVE_ENV] = "1"
    return out


def activate(*, address: str | None = None, num_cpus: float | None = None, num_gpus: int | None = None,
             native_verl: bool = False) -> None:
    """Make ``import ray`` in this process (and the workers it starts) Podium's stand-in;
    with ``native_verl``, ``verl.single_controller.ray`` Podium's own SDK too.

    Call it before the first ``import ray``: a real Ray already imported here stays what
    ``ray`` names (a ``PodiumError`` says so)."""
    from podium.errors import FailedPreconditionError

    loaded = sys.modules.get("ray")
    if loaded is not None and not getattr(loaded, "__podium__", False):
        raise FailedPreconditionError("a real `ray` is already imported in this process: call "
                                      "podium.compat.activate() before the first `import ray`")
    os.environ.update(activated_env(dict(os.environ), address=address, num_cpus=num_cpus, num_gpus=num_gpus,
                                    native_verl=native_verl))
    if RAYPATH in sys.path:
        sys.path.remove(RAYPATH)
    sys.path.insert(0, RAYPATH)
    if native_verl:
        install()
