"""deploy/kubernetes: every manifest validates against the Kubernetes API schemas (offline), and
the rendered objects say what Podium needs: the token only from the Secret, probes on the
right paths and ports, the state volume where --state points, every command a real CLI
command with real flags (a flag that does not exist fails here), the image's ENTRYPOINT.

Rendering is tests.support.kustomizekit.render (kubectl apply -k for the features used); validation is
the kubernetes-validate package, which ships the schemas. Adds about 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed "
                                          "(the test extra has it)")
pytest.importorskip("jsonpatch", reason="jsonpatch not installed (the test extra has it)")

from tests.support import kustomizekit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["base", "overlays/cpu", "job", "overlays/tls", "overlays/tls-job"]
#: The oldest Kubernetes still commonly run, and the newest the package knows.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
TOKEN_SECRET = ("podium-token", "token")
SCHEDULER_SERVICE = "podium-scheduler"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomizekit.render(K8S / name) for name in KUSTOMIZATIONS}


def _all(rendered) -> list[dict]:
    return [res for name in KUSTOMIZATIONS for res in rendered[name]]


def _one(resources, kind, name=None) -> dict:
    found = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_against_the_api_schemas(rendered, name, version):
    assert rendered[name], f"{name} renders nothing"
    for resource in rendered[name]:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {resource['kind']}/{resource['metadata']['name']} is not valid "
                        f"Kubernetes {version}: {exc.message} at {'/'.join(map(str, exc.path))}")


def test_every_yaml_file_is_rendered_somewhere(rendered):
    """A manifest no kustomization lists would be neither applied nor checked."""
    listed = set()
    folders = [K8S / n for n in KUSTOMIZATIONS]
    for folder in list(folders):
        folders += [(folder / c).resolve() for c in kustomizekit._kustomization(folder).get("components", [])]
    for folder in folders:
        spec = kustomizekit._kustomization(folder)
        listed |= {(folder / r).resolve() for r in spec.get("resources", []) if not (folder / r).is_dir()}
        listed |= {(folder / p["path"]).resolve() for p in spec.get("patches", []) if "path" in p}
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files - listed == set()


def test_token_comes_only_from_the_secret(rendered):
    resources = _all(rendered)
    assert not [r for r in resources if r["kind"] == "Secret"], "a Secret in the manifests would ship its value"
    for container in kustomizekit.containers(resources):
        env = {e["name"]: e for e in container.get("env", [])}
        token = env.get("PODIUM_TOKEN")
        assert token is not None, f"{container['name']} has no PODIUM_TOKEN"
        assert "value" not in token
        ref = token["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == TOKEN_SECRET and not ref.get("optional", False)
        for entry in container.get("env", []):
            if "value" in entry:
                assert "TOKEN" not in entry["name"], entry
        assert not any("token" in str(a).lower() for a in container.get("args", []) + container.get("command", []))


def _env_refs(container: dict, text: str) -> str:
    """``text`` with $(VAR) replaced as the kubelet does; every VAR must be defined."""
    env = {e["name"]: e for e in container.get("env", [])}

    def sub(match):
        name = match.group(1)
        assert name in env, f"{container['name']}: $({name}) is not an env variable of the container"
        return {"POD_IP": "10.1.2.3", "NODE_NAME": "gpu-node-1"}.get(name, "x")
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def _parsers() -> dict[str, callable]:
    from podium.scheduler.server import parse_args
    from podium.worker.agent.service import build_parser

    return {"scheduler": parse_args, "node": lambda argv: build_parser().parse_args(argv)}


def parse_podium_args(container: dict) -> tuple[str, argparse.Namespace]:
    """(subcommand, parsed flags) of a container that runs the image's ENTRYPOINT (podium);
    AssertionError on an unknown subcommand or flag."""
    from podium.cli.main import SUBCOMMANDS

    assert "command" not in container or container["command"] == ["podium"], container["name"]
    args = [_env_refs(container, str(a)) for a in container["args"]]
    sub, rest = args[0], args[1:]
    assert sub in SUBCOMMANDS, f"{container['name']}: podium has no subcommand {sub!r}"
    parser = _parsers()[sub]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return sub, parser(rest)
    except SystemExit:
        raise AssertionError(f"{container['name']}: `podium {' '.join(args)}` is refused by the "
                             f"real CLI: {errors.getvalue().strip()}") from None


def _entrypoint() -> list[str]:
    lines = [line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT")]
    assert len(lines) == 1
    return json.loads(lines[0].split(None, 1)[1])


def test_commands_are_the_real_cli(rendered):
    assert _entrypoint() == ["podium"]
    dockerfile = (REPO / "Dockerfile").read_text()
    seen = set()
    for container in kustomizekit.containers(_all(rendered)):
        if container.get("command", ["podium"]) == ["podium"]:
            seen.add(parse_podium_args(container)[0])
        else:
            # A script run by the image's python: it must be one the image ships.
            command = container["command"]
            assert command[0] == "python", command
            script = Path(command[1])
            assert script.parts[:4] == ("/", "opt", "podium", "examples"), command
            assert (REPO / "examples" / script.name).is_file(), command
            assert "COPY --from=build /src/examples /opt/podium/examples" in dockerfile
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            exec_ = container.get(probe, {}).get("exec")
            if exec_:
                assert exec_["command"][:3] == ["python", "-m", "podium.cli.healthprobe"], exec_
                assert importlib.util.find_spec("podium.cli.healthprobe") is not None
    assert seen == {"scheduler", "node"}


def test_a_flag_that_does_not_exist_fails(rendered):
    """The check above can fail: a made-up flag, or a flag's bad value, is refused."""
    agent = _one(rendered["base"], "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    for bad in (["--no-such-flag"], ["--port", "not-a-port"]):
        broken = copy.deepcopy(agent)
        broken["args"] = broken["args"] + bad
        with pytest.raises(AssertionError, match="refused by the real CLI"):
            parse_podium_args(broken)
    broken = copy.deepcopy(agent)
    broken["args"] = ["nodes"] + broken["args"][1:]
    with pytest.raises(AssertionError, match="no subcommand"):
        parse_podium_args(broken)


def _port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name_or_number in ports, f"{container['name']} has no port named {name_or_number}"
    return ports[name_or_number]


@pytest.mark.parametrize("name", ["base", "overlays/cpu"])
def test_scheduler(rendered, name):
    resources = rendered[name]
    sts = _one(resources, "StatefulSet", "podium-scheduler")
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, flags = parse_podium_args(container)
    # Probes: /healthz (alive) and /readyz (serving) on the port --http-port opens.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe"):
        assert _port(container, container[probe]["httpGet"]["port"]) == flags.http_port
    # The state file lives on the claim's volume.
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    state_dir = str(Path(flags.state).parent)
    assert [n for n, path in mounts.items() if path == state_dir] == ["state"] and "state" in claims
    assert flags.host == "0.0.0.0"
    # The Service sends gRPC and HTTP to the ports the scheduler listens on.
    service = _one(resources, "Service", SCHEDULER_SERVICE)
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    by_name = {p["name"]: _port(container, p["targetPort"]) for p in service["spec"]["ports"]}
    assert by_name == {"grpc": flags.port, "http": flags.http_port}
    headless = _one(resources, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def test_node_agent_on_gpu_nodes(rendered):
    ds = _one(rendered["base"], "DaemonSet", "podium-node")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, flags = parse_podium_args(container)
    # NVIDIA's device plugin: GPU nodes, its taint tolerated, the GPUs asked for (requests == limits).
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    res = container["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1
    assert res["requests"].get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"]) == res["limits"]["nvidia.com/gpu"]
    assert flags.fake_gpus is None  # real GPUs, through NVML
    _check_agent(rendered["base"], container, flags)


def test_cpu_overlay_fakes_gpus_anywhere(rendered):
    ds = _one(rendered["overlays/cpu"], "DaemonSet", "podium-node")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, flags = parse_podium_args(container)
    assert flags.fake_gpus == 4
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "nvidia.com/gpu" not in json.dumps(rendered["overlays/cpu"])
    _check_agent(rendered["overlays/cpu"], container, flags)


def _check_agent(resources, container, flags):
    # Registered (and workers bind) at the pod IP, from the downward API; served on all interfaces.
    env = {e["name"]: e for e in container["env"]}
    assert flags.host == "0.0.0.0"
    assert container["args"][container["args"].index("--advertise-address") + 1] == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # It reaches the scheduler through the Service, on the Service's gRPC port.
    service = _one(resources, "Service", SCHEDULER_SERVICE)
    host, port = flags.scheduler.rsplit(":", 1)
    assert host in (SCHEDULER_SERVICE, f"{SCHEDULER_SERVICE}.podium", f"{SCHEDULER_SERVICE}.podium.svc")
    assert int(port) == {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"]
    # Health: the gRPC probe asks the agent's own port.
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"][3:] == ["grpc", f"127.0.0.1:{flags.port}"]
    assert _port(container, "agent") == flags.port and _port(container, "metrics") == flags.metrics_port
    # Worker logs on a volume; /dev/shm big enough for same-host transfers.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert flags.log_dir in mounts and "/dev/shm" in mounts
    volumes = {v["name"]: v for v in _one(resources, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_job_runs_cluster_job_against_the_service(rendered):
    job = _one(rendered["job"], "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "/opt/podium/examples/cluster_job.py"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    host, port = env["PODIUM_ADDRESS"].rsplit(":", 1)
    service = _one(rendered["base"], "Service", SCHEDULER_SERVICE)
    assert host == SCHEDULER_SERVICE and int(port) == service["spec"]["ports"][0]["port"]
    assert all(int(n) > 0 for n in env["PODIUM_JOB_PROCESS_ON_NODES"].split(","))
    assert job["metadata"]["namespace"] == _one(rendered["base"], "StatefulSet")["metadata"]["namespace"]


def test_pods_are_locked_down(rendered):
    resources = _all(rendered)
    images = set()
    for res in resources:
        pod = kustomizekit.pod_spec(res)
        if pod is None:
            continue
        assert pod["automountServiceAccountToken"] is False, res["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's podium user
        labels = res["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "podium"  # the NetworkPolicy lets them meet
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
            assert ctx["readOnlyRootFilesystem"] is True
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
            images.add(container["image"])
    assert images == {"podium:latest"}
    policy = _one(rendered["base"], "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "podium"}


def test_the_loader_refuses_what_it_cannot_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(kustomizekit.Unsupported, match="commonLabels"):
        kustomizekit.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [../outside.yaml]\n")
    (tmp_path.parent / "outside.yaml").write_text("kind: ConfigMap\n")
    with pytest.raises(AssertionError, match="outside the kustomization"):
        kustomizekit.render(tmp_path)


def _secret_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that the file at ``path`` in ``container`` comes from."""
    mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{container['name']}: {path} is on no (or several) mounts"
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[0]["name"]]
    assert "secret" in volume, f"{path} is not from a Secret"
    return volume["secret"]["secretName"], path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]


def test_tls_overlay(rendered):
    """TLS files from the podium-tls Secret, flags and PODIUM_TLS_* agree, one server name
    everywhere, and the scheduler's probes no longer use the (client-certificate) HTTP port."""
    names = set()
    workloads = [_one(rendered["overlays/tls"], "StatefulSet"), _one(rendered["overlays/tls"], "DaemonSet"),
                 _one(rendered["overlays/tls-job"], "Job")]
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        files = {key: env[f"PODIUM_TLS_{key.upper()}"] for key in ("cert", "key", "ca")}
        assert {k: _secret_file(pod, container, v) for k, v in files.items()} == {
            "cert": ("podium-tls", "tls.crt"), "key": ("podium-tls", "tls.key"), "ca": ("podium-tls", "ca.crt")}
        assert pod["securityContext"]["fsGroup"] == 10001  # the 0440 files are readable by the pod's user
        names.add(env["PODIUM_TLS_SERVER_NAME"])
        if workload["kind"] != "Job":
            _, flags = parse_podium_args(container)
            assert (flags.tls_cert, flags.tls_key, flags.tls_ca) == (files["cert"], files["key"], files["ca"])
            for probe in ("livenessProbe", "readinessProbe"):
                assert container[probe]["exec"]["command"] == [
                    "python", "-m", "podium.cli.healthprobe", "grpc", f"127.0.0.1:{flags.port}"]
    assert names == {"podium"}
