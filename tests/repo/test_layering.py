"""Nothing imports upward, checked twice:

* each layer is imported in a fresh interpreter, and no module of a higher layer (or of a
  sibling on the same level) may have been loaded by it;
* every import statement of every product module, including those inside functions and
  under ``if TYPE_CHECKING:`` (which the first check cannot see), is read from the source
  and held against the same table, and the module graph they make has no cycle.

The layers, lowest first (``docs/architecture.md`` explains them):

1. ``podium`` core: errors, resources, codec, dataproto, auth, process, the generated ``v1``,
   the memory pool and row concatenation, and the hook the transport fills (``podium.spans``)
2. the wire: ``podium.rpc``, ``podium.transport``, ``podium.refs``, ``podium.agentlogs``,
   ``podium.workerstacks``
3. ``podium.scheduler.core``: the pure placement core
4. the services, side by side: ``podium.scheduler`` and ``podium.worker`` (node agent and
   worker host); the node agent talks to the scheduler through its client
   (``podium.scheduler.client``), never through the scheduler's own modules
5. ``podium.controller``: the SDK a training script drives
6. the top: ``podium.cli`` and the packages built on the SDK (``podium.rollout``,
   ``podium.compat``, and the stand-in read under its own name, ``ray``)

The table here and the one in ``docs/architecture.md`` section 2 are held equal.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support.waiting import REPO

CORE = ["podium.errors", "podium.resources", "podium.codec", "podium.dataproto", "podium.auth",
        "podium.process", "podium.v1", "podium.memcap", "podium.cudawire", "podium.memorypool", "podium.rowcat",
        "podium.spans", "podium.limits", "podium.private", "podium.tracering", "podium.runtimeenv", "podium.zippackage"]
WIRE = ["podium.rpc", "podium.transport", "podium.refs", "podium.borrows", "podium.agentlogs", "podium.httplimits",
        "podium.workerstacks"]
#: ``ray`` is the stand-in (podium/compat/raypath/ray), a root of its own on PYTHONPATH under
#: ``podium run``: part of the compat layer, so what imports it is seen like any other import.
TOP = ["podium.cli", "podium.rollout", "podium.compat", "ray"]
#: the scheduler's own modules (all but its client, which the node agent uses)
SCHEDULER_INSIDE = sorted(
    f"podium.scheduler.{p.stem}" for p in (REPO / "scheduler").glob("*.py") if p.stem not in ("__init__", "client")
) + ["podium.scheduler.core"]

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


# -- the same table, read from the source ---------------------------------------------------

#: import root -> source folder (pyproject.toml's package-dir)
STANDIN = REPO / "podium" / "compat" / "raypath" / "ray"
SOURCE_ROOTS = {"podium": REPO / "podium", "podium.scheduler": REPO / "scheduler",
                "podium.worker": REPO / "worker", "podium.controller": REPO / "controller",
                "ray": STANDIN}
#: what a service may take from the scheduler package: the package itself and its client
SCHEDULER_FOR_WORKERS = {"podium.scheduler", "podium.scheduler.client"}


def product_modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Every product module: dotted name -> (source file, is a package)."""
    found = {}
    for dotted, root in SOURCE_ROOTS.items():
        for path in root.rglob("*.py"):
            if dotted != "ray" and path.is_relative_to(STANDIN):
                continue  # the stand-in is named ``ray`` where it runs, not by its folder
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join([dotted, *parts])] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the product modules its source imports, at any depth of the file."""
    modules = product_modules()

    def owner(name: str) -> str | None:
        # ``from a.b import c``: c is a module when a.b.c is one, else a name in a.b.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                found = owner(target)
                if found and found != name:
                    graph[name].add(found)
    return graph


def layer_of(module: str) -> str | None:
    """The layer whose member is the longest prefix of ``module`` (None: the root facade)."""
    best, length = None, -1
    for layer, (members, _) in LAYERS.items():
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > length:
                best, length = layer, len(member)
    if best is None and any(module == t or module.startswith(t + ".") for t in TOP):
        return "top"
    return best


def upward(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` breaks the table."""
    layer = layer_of(module)
    if layer in (None, "top") or target == "podium":
        return False
    if layer == "worker" and target.startswith("podium.scheduler"):
        return target not in SCHEDULER_FOR_WORKERS
    if layer == "controller" and target.startswith("podium.worker.host"):
        return target not in WORKER_HOST_FOR_CONTROLLER
    forbidden = LAYERS[layer][1]
    return any(target == f or target.startswith(f + ".") for f in forbidden)


#: The controller's rooms, lowest first (docs/architecture.md, section 2): a room imports its
#: own and lower rooms only. The facade (``podium.controller``) stands above them all.
CONTROLLER_ROOMS = ["session", "observe", "dispatch", "pool", "group", "remote"]
#: The worker host's one public function the controller may call: the package itself.
WORKER_HOST_FOR_CONTROLLER = {"podium.worker.host"}


def room_of(module: str) -> int | None:
    """The index of ``module``'s controller room (None outside the rooms)."""
    parts = module.split(".")
    if parts[:2] != ["podium", "controller"] or len(parts) < 3:
        return None
    return CONTROLLER_ROOMS.index(parts[2]) if parts[2] in CONTROLLER_ROOMS else None


def room_upward(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` goes up the controller's rooms."""
    here, there = room_of(module), room_of(target)
    if target == "podium.controller" and here is not None:
        return True  # the facade is above every room
    return here is not None and there is not None and there > here


def test_every_module_has_a_layer():
    loose = sorted(m for m in product_modules() if m != "podium" and layer_of(m) is None)
    assert not loose, f"modules in no layer of the table: {loose}"


def test_no_import_goes_upward_even_inside_functions():
    bad = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets if upward(m, t))
    assert not bad, "imports against the layer table (lazy and type-only ones included):\n" + "\n".join(bad)


def test_controller_rooms_import_nothing_above_them():
    rooms = {p.name for p in (REPO / "controller").iterdir() if p.is_dir() and p.name != "__pycache__"}
    loose = sorted(f"controller/{p.name}" for p in (REPO / "controller").glob("*.py")
                   if p.name not in ("__init__.py", "pool.py"))
    assert rooms | {"pool"} == set(CONTROLLER_ROOMS) and not loose, (rooms, loose)
    bad = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets if room_upward(m, t))
    assert not bad, "imports against the controller's rooms:\n" + "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    # The check below passes on an empty answer, so the finder is shown to find one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_cycle_at_any_level():
    found = cycles(import_graph())
    assert not found, "import cycles (lazy and type-only imports included):\n" + "\n".join(map(str, found))


def test_upward_knows_an_upward_import():
    # As above: the table check is shown to refuse what it must.
    assert upward("podium.rowcat", "podium.transport.shmstage")
    assert upward("podium.worker.agent.service", "podium.scheduler.service")
    assert not upward("podium.worker.agent.service", "podium.scheduler.client")
    assert upward("podium.controller.remote.objects", "podium.worker.host.runtime")
    assert not upward("podium.controller.remote.objects", "podium.worker.host")
    assert upward("podium.worker.base", "ray")  # the stand-in is mapped: ``import ray`` is seen
    assert room_upward("podium.controller.session.runtime", "podium.controller.group.calls")
    assert not room_upward("podium.controller.group.calls", "podium.controller.session.futures")


#: The most lines a product module may have (generated code aside).
MAX_LINES = 500


def test_no_product_module_over_500_lines():
    long = sorted(f"{name} ({n} lines)" for name, (path, _) in product_modules().items()
                  if not name.startswith("podium.v1.") and (n := len(path.read_text().splitlines())) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines: split them by responsibility: {long}"


#: The scheduler's state: it knows no gRPC and no clock (docs/architecture.md, section 5).
SCHEDULER_STATE = ["state", "nodes", "groups", "workers", "sessions", "tables", "records", "workerspecs"]


def test_the_scheduler_state_knows_no_grpc_and_no_clock():
    graph = import_graph()
    bad = []
    for stem in SCHEDULER_STATE:
        module = f"podium.scheduler.{stem}"
        tree = ast.parse((REPO / "scheduler" / f"{stem}.py").read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        bad += [f"{module} imports {m}" for m in sorted(names & {"grpc", "time", "asyncio", "datetime"})]
        bad += [f"{module} imports {t}" for t in sorted(graph.get(module, ()))
                if t in ("podium.rpc", "podium.scheduler.service", "podium.scheduler.client")]
    assert not bad, bad


def test_the_docs_layer_table_is_this_table():
    # docs/architecture.md, section 2: one row per layer, its packages in the second column.
    import re
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| \d\. [^|]+\| ([^|]+) \|", text, flags=re.MULTILINE)
    documented = [sorted(n for n in re.findall(r"`([^`]+)`", row) if "/" not in n) for row in rows]
    table = [CORE, WIRE, ["podium.scheduler.core"], ["podium.scheduler", "podium.worker"],
             ["podium.controller"], TOP]
    assert documented == [sorted(layer) for layer in table]
    assert [members for members, _ in LAYERS.values()] == table[:3] + [["podium.scheduler"], ["podium.worker"]] + table[4:5]
