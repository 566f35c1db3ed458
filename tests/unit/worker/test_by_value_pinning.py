"""A test module's class that ``by_value`` sent first still travels by value afterwards,
when the codec meets it inside another object that names it only indirectly (verl's
colocated ``WorkerDict`` holds its role classes in a closure)."""

from __future__ import annotations

import importlib
import subprocess
import sys

from podium import codec
from podium.worker.factory import by_value

ROLES = '''
class Role:
    def value(self):
        return 41 + 1


def holder():
    role = Role

    def build():
        return role().value()

    return build
'''


def test_a_test_modules_class_sent_by_value_once_stays_by_value(tmp_path, monkeypatch):
    # A test module of its own (top-level, as pytest imports a test file beside no package):
    # importable here, not in the process that decodes.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "test_pinned_roles.py").write_text(ROLES)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    roles = importlib.import_module("test_pinned_roles")
    try:
        with by_value(roles.Role):  # the first time this module is pickled: by_value registers it...
            codec.dumps(roles.Role)
        # ...and when it is done, the codec (which met Role meanwhile) keeps it registered: a
        # closure that holds Role, named to nobody, still carries Role by value.
        payload = codec.dumps(roles.holder())
    finally:
        sys.modules.pop("test_pinned_roles", None)
    script = "import sys\nfrom podium import codec\nprint(codec.loads(sys.stdin.buffer.read())())\n"
    done = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True, cwd=tmp_path,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["42"]
