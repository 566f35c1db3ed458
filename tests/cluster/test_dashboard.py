"""The scheduler's live dashboard in headless Chromium, against a running 2-node cluster.

``podium up`` starts the cluster; a placement group and two half-GPU workers are created
through the scheduler; Chromium loads ``/#token=...``, and the test inspects the rendered
DOM (nodes, GPUs, bundle owner, workers with fractions, several refreshes) and a
screenshot (a real PNG that is not blank).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import urllib.request
import zlib

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300),
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason="needs chromium (apt-get install chromium)")]


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


def _png_pixels_vary(path) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the decompressed image data)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def _podium(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "podium.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_dashboard_renders_cluster_in_chromium(tmp_path, token, arun):
    from podium.scheduler.client import SchedulerClient
    from podium.v1 import common_pb2

    state_dir = tmp_path / "local"
    env = dict(os.environ, PODIUM_TOKEN=token)
    up = _podium("up", "--dir", str(state_dir), "--nodes", "2", "--gpus-per-node", "2",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    try:
        cluster = json.loads((state_dir / "cluster.json").read_text())
        http_url = cluster["http_url"]

        async def place():
            async with SchedulerClient(cluster["address"], token) as client:
                pg = await client.create_placement_group("dash-pg", [{"CPU": 1, "GPU": 1}], "PACK")
                await client.wait_placement_group(pg.id, timeout=60)
                specs = [common_pb2.WorkerSpec(name=f"dash-worker-{r}", group="dash", placement_group_id=pg.id,
                                               bundle_index=0, num_gpus=0.5, num_cpus=0.5, rank=r,
                                               world_size=2) for r in range(2)]
                infos = await client.create_workers(specs)
                await client.wait_workers([i.id for i in infos], timeout=120)

        arun(place(), timeout=180)

        # The page is public; its data is not.
        with urllib.request.urlopen(f"{http_url}/", timeout=10) as reply:
            assert reply.status == 200 and b"Podium cluster" in reply.read()

        dom = _chromium(tmp_path, "--virtual-time-budget=6000", "--dump-dom", f"{http_url}/#token={token}")
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        for node in ("node-127.0.0.2", "node-127.0.0.3"):
            assert f'data-node="{node}"' in html
            for gpu in (0, 1):
                assert f'data-gpu="{node}/{gpu}"' in html
        assert 'data-worker="dash-worker-0"' in html and 'data-worker="dash-worker-1"' in html
        assert "dash-pg[0] · 1" in html  # the bundle that owns the GPU
        assert html.count(" 1/2 · ") == 2  # each worker's fraction, with its memory
        assert 'data-pg="dash-pg"' in html
        refreshes = int(re.search(r'data-refreshes="(\d+)"', html).group(1))
        assert refreshes >= 2, "the page did not refresh itself"

        # Without the token the page asks for it and shows no data.
        bare = _chromium(tmp_path, "--virtual-time-budget=3000", "--dump-dom", f"{http_url}/")
        assert "needs the cluster token" in bare.stdout and "data-node=" not in bare.stdout

        shot = tmp_path / "dashboard.png"
        result = _chromium(tmp_path, "--virtual-time-budget=4000", "--window-size=1280,900",
                           f"--screenshot={shot}", f"{http_url}/#token={token}")
        assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
        width, height, distinct = _png_pixels_vary(shot)
        assert (width, height) == (1280, 900)
        assert distinct > 20, "the screenshot is blank"
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env)
        assert down.returncode == 0, down.stderr


class Steps:
    """Rank 2 is the straggler: each step takes it 40 times longer."""

    def step(self) -> int:
        import os
        import time
        rank = int(os.environ["RANK"])
        time.sleep(0.2 if rank == 2 else 0.005)
        return rank


def test_dashboard_group_view_shows_the_straggler_in_chromium(tmp_path, token):
    import podium
    from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.worker import Dispatch, Worker, register

    class Stepper(Worker, Steps):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def step(self) -> int:
            return Steps.step(self)

    state_dir = tmp_path / "local"
    env = dict(os.environ, PODIUM_TOKEN=token)
    up = _podium("up", "--dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "0", "--cpus-per-node", "8",
                 "--port", "0", "--http-port", "0", env=env)
    assert up.returncode == 0, up.stderr
    try:
        cluster = json.loads((state_dir / "cluster.json").read_text())
        http_url = cluster["http_url"]
        podium.init(address=cluster["address"], token=token)
        try:
            wg = WorkerGroup(ResourcePool([3], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Stepper),
                             name_prefix="straggle")
            for _ in range(3):
                assert wg.step() == [0, 1, 2]
            request = urllib.request.Request(f"{http_url}/v1/calls?k=5",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=30) as reply:
                calls = json.loads(reply.read())
            (group, view), = calls["groups"].items()
            assert view["ranks"] == [0, 1, 2] and len(view["methods"]["step"]) == 3
            for call in view["methods"]["step"]:  # every rank's duration, rank 2 the slowest
                assert call["ranks"]["2"]["ms"] > max(call["ranks"]["0"]["ms"], call["ranks"]["1"]["ms"])

            dom = _chromium(tmp_path, "--virtual-time-budget=8000", "--dump-dom", f"{http_url}/#token={token}")
            assert dom.returncode == 0, dom.stderr[-2000:]
            html = dom.stdout
            assert f'data-call-group="{group}"' in html and 'data-call="step"' in html
            marked = re.findall(r'class="rank-cell straggler" data-rank="(\d)"', html)
            assert marked and set(marked) == {"2"}, marked  # the slow rank stands out, and only it
            assert f'data-stacks="{group}"' in html  # the button that fetches the group's stacks
            # What the button shows: the stacks of every thread of the group's ranks.
            stacks = _chromium(tmp_path, "--virtual-time-budget=8000", "--dump-dom",
                               f"{http_url}/#token={token}&stacks={group}")
            assert f"=== group {group} rank 2" in stacks.stdout and "podium-exec" in stacks.stdout, \
                stacks.stdout[-3000:]
            wg.shutdown()
        finally:
            podium.shutdown()
    finally:
        down = _podium("down", "--dir", str(state_dir), env=env)
        assert down.returncode == 0, down.stderr
