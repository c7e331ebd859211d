"""The generated protobuf/gRPC modules in git match proto/ (regenerate: python -m mii_server.wire.regenerate)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mii_server.wire import generation_pb2, generation_pb2_grpc, regenerate

pytest.importorskip("grpc_tools", reason="grpcio-tools generates the stubs")

WIRE = Path(generation_pb2.__file__).parent
HINT = "generated stubs are stale: run `python -m mii_server.wire.regenerate` and commit mii_server/wire/"


def _descriptor_literal(text: str) -> str:
    match = re.search(r"AddSerializedFile\((b'.*?')\)", text, re.DOTALL)
    assert match, "no serialized descriptor in generated module"
    return match.group(1)


def _version(text: str) -> str | None:
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    return match.group(1) if match else None


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    fresh_pb2, fresh_grpc = regenerate.generate(tmp_path)
    # the message and service definitions, byte for byte (independent of the protoc version)
    assert _descriptor_literal(fresh_pb2.read_text()) == _descriptor_literal(
        (WIRE / "generation_pb2.py").read_text()
    ), HINT
    kept_grpc = (WIRE / "generation_pb2_grpc.py").read_text()
    new_grpc = fresh_grpc.read_text()
    if _version(new_grpc) == _version(kept_grpc):
        assert new_grpc == kept_grpc, HINT
    else:  # another grpcio-tools: compare what the service exposes
        methods = re.compile(r"'/mii_server\.wire\.Generation/(\w+)'")
        assert set(methods.findall(new_grpc)) == set(methods.findall(kept_grpc)), HINT


def test_service_has_the_rpcs_the_servers_implement() -> None:
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert [m.name for m in service.methods] == [
        "Generate",
        "GenerateStream",
        "Terminate",
        "Stats",
        "ApplyChatTemplate",
        "Tokenize",
        "TokenizerInfo",
        "GenerateMultiplexed",
    ]
    assert hasattr(generation_pb2_grpc, "GenerationStub")
