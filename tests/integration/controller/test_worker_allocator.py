"""Workers back torch's large CPU buffers with transparent huge pages (issue 30, item 4).

A method's fresh result (log-probs, values, sequences: new tensors every step) is a new glibc
mapping each call, and its first touch faulted in every 4 KiB page. The agent gives workers
``THP_MEM_ALLOC_ENABLE=1`` unless told otherwise, and torch then asks for 2 MiB pages: here a
fresh 32 MiB tensor faults some hundreds of times instead of 8,192. A worker's own environment
(``worker_env``) or the agent's switches it off; such a worker starts as a new process, as
torch in the fork server read the setting once for all its children.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import podium
from podium.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from podium.worker import Dispatch, Worker, register

pytestmark = pytest.mark.timeout(180)

NBYTES = 32 << 20
PAGES = NBYTES // 4096


@pytest.fixture(scope="module", autouse=True)
def cluster():
    podium.init()
    try:
        yield
    finally:
        podium.shutdown()


def _thp_mode() -> str:
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "absent"


class Allocator(Worker):
    """Says how many page faults its fresh tensor took, and its allocator setting."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setting(self):
        import os

        return os.environ.get("THP_MEM_ALLOC_ENABLE")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def faults_of_fresh(self, nbytes):
        import resource

        import torch

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fresh = torch.ones(nbytes // 4)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del fresh
        return faults


def _group(**kwargs) -> WorkerGroup:
    return WorkerGroup(ResourcePool([1], use_gpu=False, max_colocate_count=1), ClassWithInitArgs(Allocator),
                       **kwargs)


def test_workers_get_huge_pages_for_fresh_tensors_by_default():
    wg = _group()
    try:
        assert wg.setting()[0] == "1"
        if _thp_mode() not in ("madvise", "always"):
            pytest.skip(f"this kernel offers no transparent huge pages (mode {_thp_mode()}): nothing to measure")
        faults = wg.faults_of_fresh(NBYTES)[0]
        assert faults < PAGES // 2, f"{faults} faults for {PAGES} pages: not huge pages"
    finally:
        wg.shutdown()


def test_a_worker_env_switches_them_off():
    wg = _group(worker_env={"THP_MEM_ALLOC_ENABLE": "0"})
    try:
        assert wg.setting()[0] == "0"
        if _thp_mode() != "madvise":  # "always": the kernel gives huge pages whatever torch asks
            pytest.skip(f"huge pages follow torch's request only in the kernel's madvise mode (here {_thp_mode()})")
        faults = wg.faults_of_fresh(NBYTES)[0]
        assert faults >= PAGES * 9 // 10, f"{faults} faults for {PAGES} pages: huge pages despite the env"
    finally:
        wg.shutdown()
