"""The wire protocol: generated protobuf/gRPC modules and the one converter to our dataclasses.

``generation_pb2`` and ``generation_pb2_grpc`` are generated from ``proto/mii_server/wire/generation.proto``
and kept in git (``python -m mii_server.wire.regenerate`` rewrites them; a test fails when they are stale).
"""
