"""Compose smoke test: build the image, run docker-compose.yml end to end, take it down.

The cluster runs with docker-compose.loopback.yml on top (every service on the host
network, each on its own 127.x address: tests here may only use loopback addresses);
docker-compose.yml itself, the bridge network users get, is checked through its
rendered configuration, real-GPU variant included. Docker is this test's own daemon
(see dockerkit.py). Skipped only when docker is not installed or its daemon cannot
start here, with the reason; everything after that is a real failure.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml not installed (the test extra has it)")

from tests.support.dockerkit import (REPO, DockerDaemon, DockerUnavailable, build_context, build_podium_image,  # noqa: E402
                       compose_command, import_base_image, missing_tools, run)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1200)]

COMPOSE_FILE = REPO / "docker-compose.yml"
LOOPBACK_FILE = REPO / "docker-compose.loopback.yml"
FAKE_GPUS = 2           # per node: 2 x 2 workers keep the job light on 2 cores
HEALTHY_TIMEOUT = 180.0
JOB_TIMEOUT = 420.0


def _compose_config(files: list[Path], env: dict, project: str = "podiumcheck") -> dict:
    """The merged, interpolated configuration docker-compose would run."""
    args = [arg for path in files for arg in ("-f", str(path))]
    out = run([*compose_command(), "-p", project, *args, "config"], env=env, timeout=60, cwd=REPO)
    return yaml.safe_load(out.stdout)


def _published(port) -> tuple[str, int, int]:
    """(host_ip, published, target) from either docker-compose 1.29's string or v2's mapping."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), int(port["published"]), int(port["target"])
    match = re.fullmatch(r"(?:(?P<ip>[\d.]+):)?(?P<pub>\d+):(?P<tgt>\d+)(?:/tcp)?", str(port))
    assert match, f"unexpected port syntax {port!r}"
    return match["ip"] or "", int(match["pub"]), int(match["tgt"])


def _command(service: dict) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else list(command)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# ------------------------------------------------------------- the file users run (no daemon needed)

#: Tools the tests need, checked once at collection: a test skips only naming what is missing.
_NO_COMPOSE = None if compose_command() is not None else \
    "docker-compose not installed (apt-get install -y docker-compose)"
_NO_DAEMON_TOOLS = missing_tools() or (None if shutil.which("debootstrap") else
                                       "debootstrap not installed (apt-get install -y debootstrap)")
needs_compose = pytest.mark.skipif(_NO_COMPOSE is not None, reason=_NO_COMPOSE or "")
needs_docker = pytest.mark.skipif(_NO_DAEMON_TOOLS is not None, reason=_NO_DAEMON_TOOLS or "")


@pytest.fixture(scope="module")
def compose_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODIUM_", "COMPOSE_"))}
    env["PODIUM_TOKEN"] = secrets.token_urlsafe(24)
    return env


@needs_compose
def test_default_file_is_a_bridge_cluster_published_on_loopback_only(compose_env):
    config = _compose_config([COMPOSE_FILE], compose_env)
    services = config["services"]
    assert set(services) == {"scheduler", "node-1", "node-2", "job"}
    for name, service in services.items():
        assert "network_mode" not in service, f"{name}: the default file stays on the bridge network"
        assert service["environment"]["PODIUM_TOKEN"] == compose_env["PODIUM_TOKEN"], name
        assert service["image"] == services["scheduler"]["image"], "one image for every role"
    scheduler = services["scheduler"]
    assert "build" in scheduler
    assert sorted(_published(p) for p in scheduler["ports"]) == [
        ("127.0.0.1", 8265, 8265), ("127.0.0.1", 50051, 50051)]
    assert "/healthz" in " ".join(scheduler["healthcheck"]["test"])
    assert any("podium-state:/var/lib/podium" in str(v) or
               (isinstance(v, dict) and v.get("source") == "podium-state") for v in scheduler["volumes"])
    assert _flag(_command(scheduler), "--host") == "0.0.0.0"
    for name in ("node-1", "node-2"):
        node, command = services[name], _command(services[name])
        assert _flag(command, "--scheduler") == "scheduler:50051", "agents find the scheduler by name"
        assert _flag(command, "--advertise-address") == name, "workers are reached by service name"
        assert _flag(command, "--fake-gpus") == "4"
        assert "ports" not in node, "only the scheduler is published"
        assert node["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert "podium.cli.healthprobe" in " ".join(node["healthcheck"]["test"])
        assert any("podium-logs" in str(v) for v in node["volumes"])
    job = services["job"]
    assert job["profiles"] == ["job"], "the example job runs on demand (docker compose run job)"
    assert job["environment"]["PODIUM_ADDRESS"] == "scheduler:50051"
    assert "/examples/cluster_job.py" in job["entrypoint"]
    assert set(config["volumes"]) == {"podium-state", "podium-logs"}


@needs_compose
def test_the_token_is_required(compose_env):
    env = {k: v for k, v in compose_env.items() if k != "PODIUM_TOKEN"}
    proc = run([*compose_command(), "-f", str(COMPOSE_FILE), "config"], env=env, timeout=60, check=False,
               cwd="/")  # not REPO: a developer's .env there could supply one
    assert proc.returncode != 0
    assert "PODIUM_TOKEN" in proc.stdout + proc.stderr


@needs_compose
def test_the_commented_real_gpu_variant_is_valid(compose_env, tmp_path):
    lines = COMPOSE_FILE.read_text().splitlines()
    start = lines.index("  # node-gpu:")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("  #"))
    uncommented = [("  " + line[4:]) for line in lines[start:end]]
    assert all(line.startswith("  # ") for line in lines[start:end])
    variant = tmp_path / "docker-compose.yml"
    variant.write_text("\n".join(lines[:start] + uncommented + lines[end:]) + "\n")
    node = _compose_config([variant], compose_env)["services"]["node-gpu"]
    assert "--fake-gpus" not in _command(node), "a real-GPU node asks NVML"
    devices = node["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


# ------------------------------------------------------------- end to end, on a private daemon

@pytest.fixture(scope="module")
def daemon():
    try:
        started = DockerDaemon().start()
    except DockerUnavailable as exc:
        # The tools are there but this kernel/sandbox cannot run a daemon (no cgroups,
        # no overlay, ...): the reason carries dockerd's own error lines.
        pytest.skip(f"dockerd cannot run here: {exc}")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def image(daemon, tmp_path_factory):
    t0 = time.monotonic()
    base = import_base_image(daemon, "podium-test-base:bookworm")
    t1 = time.monotonic()
    context = build_context(tmp_path_factory.mktemp("compose") / "context")
    tag = build_podium_image(daemon, context, base, "podium:compose-test")
    print(f"\nbase image {t1 - t0:.0f}s, podium image {time.monotonic() - t1:.0f}s")
    return tag


class Cluster:
    """The compose project, rendered once from docker-compose.yml + docker-compose.loopback.yml."""

    def __init__(self, daemon: DockerDaemon, image: str, workdir: Path) -> None:
        self.daemon = daemon
        self.project = f"podiumtest{secrets.token_hex(3)}"
        self.token = secrets.token_urlsafe(24)
        # A /24 of its own: concurrent runs (each with its own daemon) never share an address.
        block = f"127.77.{random.randrange(1, 255)}"
        self.scheduler_ip, self.node_ips = f"{block}.1", (f"{block}.2", f"{block}.3")
        self.env = dict(daemon.env, PODIUM_TOKEN=self.token, PODIUM_IMAGE=image,
                        PODIUM_FAKE_GPUS=str(FAKE_GPUS), PODIUM_JOB_PROCESS_ON_NODES=f"{FAKE_GPUS},{FAKE_GPUS}",
                        PODIUM_SCHEDULER_IP=self.scheduler_ip, PODIUM_NODE1_IP=self.node_ips[0],
                        PODIUM_NODE2_IP=self.node_ips[1])
        config = _compose_config([COMPOSE_FILE, LOOPBACK_FILE], self.env, self.project)
        for service in config["services"].values():
            assert service.get("network_mode") == "host" and service.get("ipc") == "host"
            # On the host network Docker discards published ports; docker-compose 1.29 refuses
            # the combination outright (compose v2 warns), so the rendered file drops them.
            service.pop("ports", None)
        self.file = workdir / "docker-compose.rendered.yml"
        self.file.write_text(yaml.safe_dump(config))
        self.http = f"http://{self.scheduler_ip}:8265"

    def compose(self, *args: str, timeout: float = 300.0, check: bool = True):
        """Run a compose command on the rendered project."""
        return run([*compose_command(), "-p", self.project, "-f", str(self.file), *args],
                   env=self.env, timeout=timeout, check=check, cwd=REPO)

    def containers(self, all_states: bool = True) -> list[str]:
        """Ids of this project's containers (running only unless ``all_states``)."""
        args = ["ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"]
        out = self.daemon.docker(*args, *(["-a"] if all_states else []), timeout=60)
        return out.stdout.split()

    def states(self) -> dict[str, tuple[str, str]]:
        """service -> (container state, health) of every container."""
        ids = self.containers()
        if not ids:
            return {}
        fmt = ('{{index .Config.Labels "com.docker.compose.service"}} {{.State.Status}} '
               '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}')
        out = self.daemon.docker("inspect", "--format", fmt, *ids, timeout=60)
        return {name: (state, health) for name, state, health in
                (line.split() for line in out.stdout.splitlines() if line.strip())}

    def wait_healthy(self, services: set[str]) -> dict:
        """Wait (with a deadline) until every service is running and healthy."""
        deadline = time.monotonic() + HEALTHY_TIMEOUT
        while True:
            states = self.states()
            if set(states) >= services and all(states[s] == ("running", "healthy") for s in services):
                return states
            broken = {s: st for s, st in states.items() if st[0] in ("exited", "dead") or st[1] == "unhealthy"}
            if broken or time.monotonic() > deadline:
                logs = self.compose("logs", "--no-color", "--tail", "40", check=False).stdout
                raise AssertionError(f"cluster not healthy: {states}\n{logs[-6000:]}")
            time.sleep(1.0)

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        """HTTP GET on the scheduler from the host (status, body)."""
        request = urllib.request.Request(self.http + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def down(self) -> None:
        """Stop and remove containers, volumes and (none here) networks."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300)


@pytest.fixture(scope="module")
def compose_cluster(daemon, image, tmp_path_factory):
    compose_cluster = Cluster(daemon, image, tmp_path_factory.mktemp("project"))
    t0 = time.monotonic()
    try:
        compose_cluster.compose("up", "-d", "--no-build")
        compose_cluster.states_at_up = compose_cluster.wait_healthy({"scheduler", "node-1", "node-2"})
        print(f"\ncluster healthy {time.monotonic() - t0:.0f}s after up")
        yield compose_cluster
    finally:
        if compose_cluster.containers():
            compose_cluster.down()


@needs_docker
def test_cluster_comes_up_healthy_with_both_nodes_and_their_gpus(compose_cluster):
    assert compose_cluster.states_at_up == {s: ("running", "healthy") for s in ("scheduler", "node-1", "node-2")}
    assert compose_cluster.get("/healthz") == (200, b"ok")
    assert compose_cluster.get("/v1/placement")[0] == 401, "placement needs the cluster token"
    status, body = compose_cluster.get("/v1/placement", compose_cluster.token)
    assert status == 200
    nodes = {node["node_id"]: node for node in json.loads(body)["nodes"]}
    assert set(nodes) == {"node-1", "node-2"}
    uuids = set()
    for name, address in zip(("node-1", "node-2"), compose_cluster.node_ips):
        node = nodes[name]
        assert node["state"] == "NODE_ALIVE" and node["address"] == address
        assert [gpu["index"] for gpu in node["gpus"]] == list(range(FAKE_GPUS))
        uuids |= {gpu["uuid"] for gpu in node["gpus"]}
    assert len(uuids) == 2 * FAKE_GPUS, "every GPU of the cluster has its own UUID"


@needs_docker
def test_example_job_runs_a_worker_group_over_both_nodes(compose_cluster):
    t0 = time.monotonic()
    proc = compose_cluster.compose("run", "--rm", "job", timeout=JOB_TIMEOUT, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"job exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\njob ran in {elapsed:.0f}s: {result['checks']}")
    assert result["world_size"] == 2 * FAKE_GPUS
    assert result["nodes"] == sorted(compose_cluster.node_ips), "the group spans both nodes"
    assert all(result["checks"].values()), result["checks"]
    per_node = {ip: sorted(r["cuda_visible_devices"] for r in result["ranks"] if r["node"] == ip)
                for ip in compose_cluster.node_ips}
    assert per_node == {ip: [str(i) for i in range(FAKE_GPUS)] for ip in compose_cluster.node_ips}
    # Each worker's output went to the logs volume of its node agent.
    for name in ("node-1", "node-2"):
        listing = compose_cluster.compose("exec", "-T", name, "ls", f"/var/log/podium/{name}", timeout=60)
        assert listing.stdout.split(), f"no worker logs on {name}"


@needs_docker
def test_down_leaves_no_container(compose_cluster):
    assert compose_cluster.containers(all_states=False), "the cluster was running"
    compose_cluster.down()
    assert compose_cluster.containers() == []
    volumes = compose_cluster.daemon.docker("volume", "ls", "-q", "--filter",
                                    f"label=com.docker.compose.project={compose_cluster.project}", timeout=60)
    assert volumes.stdout.split() == []
