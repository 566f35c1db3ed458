"""Nothing imports upward: each layer is imported in a fresh interpreter, and no module of a
higher layer (or of a sibling on the same level) may have been loaded by it.

The layers, lowest first (``docs/architecture.md`` explains them):

1. ``podium`` core: errors, resources, codec, dataproto, auth, process, the generated ``v1``,
   the memory pool and row concatenation, and the hook the transport fills (``podium.spans``)
2. the wire: ``podium.rpc``, ``podium.transport``, ``podium.refs``, ``podium.agentlogs``
3. ``podium.scheduler.core``: the pure placement core
4. the services, side by side: ``podium.scheduler`` and ``podium.worker`` (node agent and
   worker host); the node agent talks to the scheduler through its client
   (``podium.scheduler.client``), never through the scheduler's own modules
5. ``podium.controller``: the SDK a training script drives
6. the top: ``podium.cli`` and role packages built on the SDK (``podium.rollout``,
   ``podium.compat``)
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

CORE = ["podium.errors", "podium.resources", "podium.codec", "podium.dataproto", "podium.auth",
        "podium.process", "podium.v1", "podium.memcap", "podium.cudawire", "podium.memorypool", "podium.rowcat",
        "podium.spans"]
WIRE = ["podium.rpc", "podium.transport", "podium.refs", "podium.agentlogs"]
TOP = ["podium.cli", "podium.rollout", "podium.compat"]
#: the scheduler's own modules (all but its client, which the node agent uses)
SCHEDULER_INSIDE = ["podium.scheduler.core", "podium.scheduler.dashboard", "podium.scheduler.http",
                    "podium.scheduler.server", "podium.scheduler.service", "podium.scheduler.state",
                    "podium.scheduler.store"]

#: layer name -> (packages/modules in it, prefixes it must never load)
LAYERS = {
    "core": (CORE, [*WIRE, "podium.scheduler", "podium.worker", "podium.controller", *TOP]),
    "wire": (WIRE, ["podium.scheduler", "podium.worker", "podium.controller", *TOP]),
    "scheduling core": (["podium.scheduler.core"],
                        [*WIRE, "podium.scheduler.server", "podium.scheduler.service", "podium.worker",
                         "podium.controller", *TOP]),
    "scheduler": (["podium.scheduler"], ["podium.worker", "podium.controller", *TOP]),
    "worker": (["podium.worker"], [*SCHEDULER_INSIDE, "podium.controller", *TOP]),
    "controller": (["podium.controller"], TOP),
}


def modules_under(name: str) -> list[str]:
    """Every importable module of package ``name`` (or ``[name]`` for a plain module)."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    assert spec is not None, name
    if not spec.submodule_search_locations:
        return [name]
    found = [name]
    for location in spec.submodule_search_locations:
        base = pathlib.Path(location)
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "__main__" in parts or any(p.startswith("_") and p != "__init__" for p in rel.parts[:-1]):
                continue
            found.append(".".join([name, *parts]))
    return sorted(set(found))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_imports_nothing_above_it(layer):
    members, forbidden = LAYERS[layer]
    modules = [m for member in members for m in modules_under(member)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"forbidden = {forbidden!r}\n"
        "bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in forbidden))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"layer {layer!r} imports upward:\n{done.stderr[-2000:]}"
