"""What ``Worker.Stacks`` answers (worker/host/threadstacks.py) and what the agent reads from
/proc (podium.process.kernel_state), in this process and in a stopped child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from podium import errors, process
from podium.worker.host.threadstacks import MAX_FRAMES, thread_stacks
from tests.support.waiting import eventually


def _deep(n: int, ready: threading.Event, release: threading.Event) -> None:
    if n:
        return _deep(n - 1, ready, release)
    ready.set()
    release.wait(60)


def test_every_thread_with_its_frames_and_the_outer_ones_counted():
    ready, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_deep, args=(50, ready, release), name="deep-one", daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        stacks = {t.name: t for t in thread_stacks(max_frames=10)}
        deep = stacks["deep-one"]
        assert deep.daemon and deep.native_id == worker.native_id and deep.ident == worker.ident
        assert "release.wait(60)" in deep.stack and "in _bootstrap" not in deep.stack
        assert deep.frames_omitted >= 40  # 51 _deep frames, run(), the bootstrap: 10 kept
        main = stacks["MainThread"]
        assert "test_every_thread_with_its_frames" in main.stack and main.frames_omitted >= 0
        whole = {t.name: t for t in thread_stacks()}["deep-one"]
        # traceback folds the recursion ("[Previous line repeated N more times]"); none left out.
        assert whole.frames_omitted == 0 and "in _deep" in whole.stack and "repeated" in whole.stack
    finally:
        release.set()
        worker.join(30)


@pytest.mark.parametrize("bad", [-1, MAX_FRAMES + 1])
def test_max_frames_is_bounded(bad):
    with pytest.raises(errors.InvalidArgumentError):
        thread_stacks(bad)


def test_kernel_state_of_a_stopped_child_and_of_no_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        letter, name, _, threads = eventually(lambda: (lambda s: s if s[0] == "S" else None)(
            process.kernel_state(child.pid)), "the child asleep")
        assert name == "sleeping" and threads >= 1
        os.kill(child.pid, signal.SIGSTOP)
        letter, name, wchan, _ = eventually(lambda: (lambda s: s if s[0] == "T" else None)(
            process.kernel_state(child.pid)), "the child stopped")
        assert name == "stopped"
        assert wchan in ("", "do_signal_stop")  # hidden on some kernels, else the stop's function
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(30)
    assert process.kernel_state(child.pid) == ("", "not running", "", 0)
