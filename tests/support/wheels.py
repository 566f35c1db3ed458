"""A tiny pure-Python wheel built in a test, so runtime_env ``pip`` tests install without a
package index (pip installs a local wheel with no dependencies offline)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

__all__ = ["tiny_wheel"]


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def tiny_wheel(folder: Path, name: str, version: str, value: str) -> Path:
    """A wheel of the module ``name`` (``name.VALUE == value``), version ``version``, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: podium-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},{_digest(data)},{len(data)}\n" for path, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path
