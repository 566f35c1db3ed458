"""The committed generated modules must match what tools/gen_proto.py makes from the .proto files."""

import importlib.util
import pathlib

from tests.support.waiting import REPO

ROOT = REPO


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_protos(tmp_path):
    written = _load_generator().generate(tmp_path)
    assert written, "protoc wrote nothing"
    committed_dir = ROOT / "podium" / "v1"
    for fresh in written:
        committed = committed_dir / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed: run python tools/gen_proto.py"
        assert committed.read_text() == fresh.read_text(), (
            f"{fresh.name} drifted from the .proto files: run python tools/gen_proto.py")
    committed_names = {p.name for p in committed_dir.glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in written}, "stale generated files are committed"


def test_every_service_rpc_message_field_and_enum_value_is_documented(tmp_path):
    # The .proto comments are the documentation of the wire (mypy-protobuf turns them into
    # docstrings), so every service, RPC, message, field and enum value needs one, except
    # request/response wrappers whose RPC comment already says everything and enum zero values.
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc
    import grpc_tools

    out = tmp_path / "set.pb"
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto" / "podium" / "v1").glob("*.proto"))
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", "--include_source_info",
                        f"--descriptor_set_out={out}", *protos]) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    missing = []
    for file in fds.file:
        documented = {tuple(loc.path) for loc in file.source_code_info.location
                      if loc.leading_comments.strip() or loc.trailing_comments.strip()}
        for si, service in enumerate(file.service):
            if (6, si) not in documented:
                missing.append(f"service {service.name}")
            for mi, method in enumerate(service.method):
                if (6, si, 2, mi) not in documented:
                    missing.append(f"rpc {service.name}.{method.name}")
        for ei, enum in enumerate(file.enum_type):
            if (5, ei) not in documented:
                missing.append(f"enum {enum.name}")
            for vi, value in enumerate(enum.value):
                if value.number != 0 and (5, ei, 2, vi) not in documented:
                    missing.append(f"{enum.name}.{value.name}")
        for mi, message in enumerate(file.message_type):
            wrapper = message.name.endswith(("Request", "Response"))
            if not wrapper and (4, mi) not in documented:
                missing.append(f"message {message.name}")
            for fi, field in enumerate(message.field):
                if not (wrapper and len(message.field) <= 1) and (4, mi, 2, fi) not in documented:
                    missing.append(f"{file.name}: {message.name}.{field.name}")
    assert not missing, "undocumented in the .proto files:\n" + "\n".join(missing)
