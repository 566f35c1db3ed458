"""Acting as a second local user (uid 65534) in security tests: ``setpriv`` as root, with the
system Python (the test venv may sit in a folder that user cannot read)."""

from __future__ import annotations

import os
import shutil

import pytest

#: The uid (and gid) of the other local user.
UID = 65534
#: The command prefix that runs what follows as that user.
NOBODY = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"]
#: A Python that user can run.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
#: Marks a test that acts as the second user; skipped, naming what is missing, elsewhere.
SECOND_USER = pytest.mark.skipif(
    SYSTEM_PYTHON is None or shutil.which("setpriv") is None or os.geteuid() != 0,
    reason="needs root, setpriv and /usr/bin/python3 to act as a second local user (uid 65534)")
