"""Regenerate the protobuf/gRPC modules from ``proto/`` (needs grpcio-tools; source checkouts only).

Usage: ``python -m mii_server.wire.regenerate`` from anywhere inside a source checkout. The test
``tests/server/test_wire_stubs.py`` calls :func:`generate` into a temporary directory and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_NAME = "mii_server/wire/generation.proto"
REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the proto file, writing ``mii_server/wire/generation_pb2*.py`` under ``out_dir``."""
    from grpc_tools import protoc  # why lazy: grpcio-tools is a build-time tool, absent on some machines

    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_ROOT / PROTO_NAME),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_NAME}")
    base = out_dir / "mii_server" / "wire"
    return [base / "generation_pb2.py", base / "generation_pb2_grpc.py"]


def main() -> int:
    written = generate(REPO_ROOT)
    for path in written:
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
