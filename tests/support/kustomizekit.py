"""Render a kustomization the way ``kubectl apply -k`` does, for the features deploy/kubernetes uses.

Supported: ``resources`` (files inside the kustomization's folder, or folders holding
a kustomization), ``components``, ``patches`` given as JSON 6902 operations (``path`` or
inline ``patch``, with a ``target``), ``namespace`` and ``images``. Any other field, or
a strategic-merge patch, raises :class:`Unsupported`: a manifest must never depend on
something this loader would silently skip, or the tests would check the wrong objects.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import yaml

#: Fields of kustomization.yaml this renderer implements.
FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "namespace", "images"}
#: Kinds that live outside namespaces (kustomize leaves their metadata.namespace alone).
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass", "RuntimeClass"}


class Unsupported(Exception):
    """The kustomization uses something this renderer does not implement."""


def _load_yaml(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(folder: Path) -> dict:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (folder / name).is_file():
            data = yaml.safe_load((folder / name).read_text()) or {}
            unknown = set(data) - FIELDS
            if unknown:
                raise Unsupported(f"{folder / name}: fields {sorted(unknown)} are not rendered by this loader")
            return data
    raise Unsupported(f"{folder}: no kustomization.yaml")


def _matches(resource: dict, target: dict) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": resource["kind"],
            "name": resource["metadata"]["name"], "namespace": resource["metadata"].get("namespace")}
    for key, value in target.items():
        if key not in want:
            raise Unsupported(f"patch target field {key!r} is not rendered by this loader")
        if want[key] != value:
            return False
    return True


def _apply_patches(resources: list[dict], patches: list[dict], folder: Path) -> None:
    for entry in patches:
        if "path" in entry:
            ops = yaml.safe_load(_inside(folder, entry["path"]).read_text())
        else:
            ops = yaml.safe_load(entry["patch"])
        if not isinstance(ops, list):
            raise Unsupported(f"{folder}: only JSON 6902 patches (a list of operations) are rendered here")
        target = entry.get("target")
        if not target:
            raise Unsupported(f"{folder}: a JSON 6902 patch needs a target")
        hits = [i for i, res in enumerate(resources) if _matches(res, target)]
        if not hits:
            raise AssertionError(f"{folder}: patch target {target} matches no resource")
        for i in hits:
            resources[i] = jsonpatch.apply_patch(resources[i], ops)


def _inside(folder: Path, rel: str) -> Path:
    # kubectl's default load restrictor: files only from inside the kustomization's folder.
    path = (folder / rel).resolve()
    if folder.resolve() not in path.parents:
        raise AssertionError(f"{folder}: {rel} is outside the kustomization folder (kubectl refuses it)")
    return path


def render(folder: str | Path) -> list[dict]:
    """The objects ``kubectl apply -k folder`` would send, in order."""
    folder = Path(folder)
    spec = _kustomization(folder)
    if spec.get("kind", "Kustomization") not in ("Kustomization", "Component"):
        raise Unsupported(f"{folder}: kind {spec.get('kind')}")
    resources: list[dict] = []
    for rel in spec.get("resources", []):
        target = folder / rel
        if target.is_dir():
            resources += render(target)
        else:
            resources += _load_yaml(_inside(folder, rel))
    for rel in spec.get("components", []):
        component = folder / rel
        if _kustomization(component).get("kind") != "Component":
            raise AssertionError(f"{component} is listed as a component but is not kind: Component")
        comp_spec = _kustomization(component)
        for res in comp_spec.get("resources", []):
            resources += _load_yaml(_inside(component, res))
        _apply_patches(resources, comp_spec.get("patches", []), component)
    _apply_patches(resources, spec.get("patches", []), folder)
    resources = copy.deepcopy(resources)
    if spec.get("namespace"):
        for res in resources:
            if res["kind"] not in CLUSTER_SCOPED:
                res["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for container in containers(resources):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
    return resources


def pod_spec(resource: dict) -> dict | None:
    """The pod template spec of a workload (None for other kinds)."""
    if resource["kind"] in ("StatefulSet", "DaemonSet", "Deployment", "Job", "ReplicaSet"):
        return resource["spec"]["template"]["spec"]
    if resource["kind"] == "Pod":
        return resource["spec"]
    return None


def containers(resources: list[dict]) -> list[dict]:
    """Every container (init containers too) of every workload."""
    out = []
    for res in resources:
        spec = pod_spec(res)
        if spec:
            out += spec.get("initContainers", []) + spec["containers"]
    return out
