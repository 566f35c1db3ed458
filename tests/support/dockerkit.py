"""Docker for the compose smoke test: a private dockerd, a locally built base image, the podium image.

Nothing is pulled: the base image is a Debian bookworm minbase with python3 made by
debootstrap and imported (cached as a tarball, keyed by what went into it), and the
podium image is built from the repository's Dockerfile with wheels built on this host
(``pip install --no-index`` inside). The daemon is this test's own: its data, exec root
and socket live in a temporary directory, it creates no bridge and touches no iptables
(every container runs on the host network, on loopback addresses), and it is stopped
and removed at the end.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from podium.process import die_with_parent_argv

REPO = Path(__file__).resolve().parents[2]  # the repository root

#: What goes into the base image; its hash names the cached tarball.
DEBOOTSTRAP_SUITE = "bookworm"
DEBOOTSTRAP_ARGS = ("--variant=minbase", "--include=python3,python3-venv,python3-pip")

DAEMON_START_TIMEOUT = 60.0


class DockerUnavailable(Exception):
    """Docker cannot run here; the message names the missing binary or capability."""


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 120.0, check: bool = True,
        cwd: str | os.PathLike | None = None, stdin=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a deadline; a failure raises AssertionError carrying its output."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdin=stdin, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def compose_command() -> list[str] | None:
    """``docker-compose`` (1.29) or the ``docker compose`` plugin, whichever exists."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def missing_tools() -> str | None:
    """Why docker cannot be started here by this process, or None when it can be tried."""
    missing = [name for name in ("dockerd", "docker") if not shutil.which(name)]
    if compose_command() is None:
        missing.append("docker-compose")
    if missing:
        return (f"{', '.join(missing)} not installed "
                "(apt-get install -y docker.io docker-compose debootstrap)")
    if os.geteuid() != 0:
        return "starting a private dockerd needs root"
    return None


class DockerDaemon:
    """A private dockerd: own data root, exec root and socket under one temporary directory."""

    def __init__(self) -> None:
        # Short path: containerd's and the daemon's unix sockets live under it.
        self.dir = Path(tempfile.mkdtemp(prefix="podium-dockerd-", dir="/tmp"))
        self.socket = self.dir / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "dockerd.log"

    @property
    def env(self) -> dict[str, str]:
        """Environment for docker/docker-compose commands talking to this daemon."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DOCKER_", "COMPOSE_")) and k != "PODIUM_TOKEN"}
        # The classic builder: the Debian engine has no buildx plugin.
        env.update(DOCKER_HOST=self.host, DOCKER_BUILDKIT="0", COMPOSE_DOCKER_CLI_BUILD="0")
        return env

    def start(self) -> "DockerDaemon":
        """Start dockerd; overlay2 first, vfs when the filesystem refuses overlay.

        Raises DockerUnavailable with the daemon's own error lines when neither starts.
        """
        failures = []
        for driver in (None, "vfs"):
            problem = self._try_start(driver)
            if problem is None:
                return self
            failures.append(f"[storage driver {driver or 'default'}] {problem}")
        self.stop()  # a failed dockerd leaves its data-root mounts behind too
        raise DockerUnavailable("dockerd cannot start here: " + " | ".join(failures))

    def _try_start(self, storage_driver: str | None) -> str | None:
        root = self.dir / f"root-{storage_driver or 'default'}"
        cmd = ["dockerd", "--data-root", str(root), "--exec-root", str(self.dir / "exec"),
               "-H", self.host, "--pidfile", str(self.dir / "docker.pid"),
               "--iptables=false", "--ip-masq=false", "--bridge=none"]
        if storage_driver:
            cmd += ["--storage-driver", storage_driver]
        log = open(self.log_path, "ab")
        # Own session: a forced stop can kill dockerd and the containerd it started, nothing else.
        # SIGTERM when pytest dies (killed by a timeout, no teardown): dockerd then stops the
        # containers and its containerd itself instead of outliving the run.
        self.proc = subprocess.Popen(die_with_parent_argv(cmd, signal.SIGTERM), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + DAEMON_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return self._log_errors()
            probe = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                                   env=self.env, capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                return None
            time.sleep(0.5)
        self._halt()
        return f"no answer within {DAEMON_START_TIMEOUT:g}s; {self._log_errors()}"

    def _log_errors(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        bad = [line for line in lines if "level=fatal" in line or "level=error" in line or "failed" in line]
        return " / ".join((bad or lines)[-3:]) or "no output"

    def stop(self) -> None:
        """Stop the daemon and remove its directory (mounts included)."""
        self._halt()
        # A stopped dockerd leaves mounts behind (its data root, exec/netns/default).
        for mount in self._mounts_inside():
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _halt(self) -> None:
        """SIGTERM dockerd (it stops its containers and containerd), SIGKILL its session after 60 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self.proc is not None:
            try:  # the managed containerd shares the session; never leave it behind
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None

    def _mounts_inside(self) -> list[str]:
        """Mount points under this daemon's directory, deepest first."""
        prefix = str(self.dir) + "/"
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
        return sorted(points, key=len, reverse=True)

    def docker(self, *args: str, timeout: float = 120.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run ``docker ARGS`` against this daemon."""
        return run(["docker", *args], env=self.env, timeout=timeout, check=check, **kw)


def cache_dir() -> Path:
    """Where the base image tarball is kept between runs ($PODIUM_TEST_CACHE or ~/.cache/podium-tests)."""
    path = Path(os.environ.get("PODIUM_TEST_CACHE") or Path.home() / ".cache" / "podium-tests")
    path.mkdir(parents=True, exist_ok=True)
    return path


def base_image_tarball() -> Path:
    """A tarball of the Debian base root filesystem: cached, else made with debootstrap (~2 min)."""
    key = hashlib.sha256(repr((DEBOOTSTRAP_SUITE, DEBOOTSTRAP_ARGS, platform.machine())).encode())
    tarball = cache_dir() / f"debian-{DEBOOTSTRAP_SUITE}-python3-{key.hexdigest()[:16]}.tar"
    if tarball.exists():
        return tarball
    if not shutil.which("debootstrap"):
        raise DockerUnavailable("debootstrap not installed (apt-get install -y debootstrap): "
                                "the base image is built locally, nothing can be pulled")
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache_dir()))
    try:
        run(["debootstrap", *DEBOOTSTRAP_ARGS, DEBOOTSTRAP_SUITE, str(work / "rootfs")], timeout=900)
        partial = work / "rootfs.tar"
        run(["tar", "-C", str(work / "rootfs"), "-cf", str(partial), "."], timeout=300)
        partial.replace(tarball)  # atomic: a killed run never leaves half a tarball behind
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def import_base_image(daemon: DockerDaemon, name: str) -> str:
    """Import the base tarball into ``daemon`` as ``name``."""
    tarball = base_image_tarball()
    daemon.docker("import", str(tarball), name, timeout=300)
    return name


def build_context(dest: Path) -> Path:
    """The repository's files (as a fresh clone plus uncommitted work has them) and a wheelhouse.

    The wheelhouse holds every wheel podium needs, built or copied on this host by pip
    (torch at the version installed here), plus setuptools and wheel to build podium's own
    wheel inside the image.
    """
    dest.mkdir(parents=True)
    listing = None
    if (REPO / ".git").exists() and shutil.which("git"):
        listing = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                                 capture_output=True, timeout=60)
    if listing is not None and listing.returncode == 0:
        for rel in filter(None, listing.stdout.decode().split("\0")):
            src = REPO / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis"))
    wheels = dest / "wheelhouse"
    torch_version = importlib.metadata.version("torch")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), str(dest),
         f"torch=={torch_version}", "setuptools", "wheel"], timeout=600)
    for built in wheels.glob("podium-*.whl"):  # the image builds its own from the sources
        built.unlink()
    return dest


def build_podium_image(daemon: DockerDaemon, context: Path, base: str, tag: str) -> str:
    """``docker build`` the repository's Dockerfile on ``base``, offline (wheels from the context)."""
    daemon.docker("build", "-q", "-t", tag, "-f", str(context / "Dockerfile"),
                  "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", "PIP_NO_INDEX=1",
                  "--build-arg", "PIP_FIND_LINKS=/src/wheelhouse", str(context), timeout=900)
    return tag
