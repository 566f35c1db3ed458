"""Regenerate the committed gRPC/protobuf modules in podium/v1/ from proto/podium/v1/*.proto.

Run from anywhere: ``python tools/gen_proto.py``. With ``--check DIR`` it
writes into DIR instead (the drift test compares DIR with the committed files).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "podium" / "v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto into ``out_root/podium/v1`` and return the files written."""
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    (out_root / "podium" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        # mypy-protobuf writes the .pyi stubs with every .proto comment as a docstring.
        f"--plugin=protoc-gen-mypy={shutil.which('protoc-gen-mypy')}",
        f"--mypy_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "podium" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="output root (default: the repository root, so podium/v1/)")
    ns = parser.parse_args()
    for path in generate(ns.out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
