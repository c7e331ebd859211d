"""gRPC plumbing shared by every process: asyncio servers, channel options, health service and checks."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..wire import generation_pb2_grpc
from .security import ApiKeys, GrpcSecurity, aio_interceptors, intercepted

SERVICE_NAME = "mii_server.wire.Generation"
MAX_MESSAGE_BYTES = 2**27  # MII's GRPC_MAX_MSG_SIZE

_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = _SIZE_OPTIONS + [
    # why: with SO_REUSEPORT (gRPC's default) a second server binds an occupied port silently and
    # steals half its traffic; a port in use must be an error instead.
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = _SIZE_OPTIONS + [
    # why: a restarted replica must be reachable within a second, not after gRPC's 2-minute backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


async def start_server(
    servicer: generation_pb2_grpc.GenerationServicer, host: str, port: int, security: GrpcSecurity | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Start an asyncio gRPC server with our service and grpc.health.v1 (NOT_SERVING until the caller
    says). No thread per RPC: every call is a task on the running event loop.

    Raises ``OSError`` when the port cannot be bound.
    """
    security = security or GrpcSecurity(ApiKeys([]))
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.server_interceptors())
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, False)
    try:
        bound = security.add_port(server, f"{host}:{port}")
    except RuntimeError as err:  # grpcio >= 1.60 raises; older ones return 0
        raise OSError(f"cannot listen on {host}:{port}: {err}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    await server.start()
    return server, health_servicer


# The load balancer's health for this service name is SERVING only while it routes to every
# replica; the supervisor waits for it, so the first request after serve() can use them all.
ALL_REPLICAS_SERVICE = "mii_server.AllReplicas"


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Both the process ("") and the model service (``SERVICE_NAME``)."""
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _status(serving))


async def set_service_serving(health_servicer: health.aio.HealthServicer, service: str, serving: bool) -> None:
    """One service name: "" is the process itself (liveness), ``SERVICE_NAME`` what it serves (readiness)."""
    await health_servicer.set(service, _status(serving))


async def set_all_replicas_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    await set_service_serving(health_servicer, ALL_REPLICAS_SERVICE, serving)


def channel(address: str, api_key: str = "", credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel that presents ``api_key`` on every call (and speaks TLS with ``credentials``)."""
    if credentials is None:
        plain = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        plain = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    return intercepted(plain, api_key)


def aio_channel(
    address: str, api_key: str = "", credentials: grpc.ChannelCredentials | None = None
) -> grpc.aio.Channel:
    """The asyncio twin of ``channel`` (it belongs to the running event loop)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=aio_interceptors(api_key))
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS, interceptors=aio_interceptors(api_key))


def security_channel(address: str, security: GrpcSecurity) -> grpc.Channel:
    """A channel from one process of the deployment to another: its key, its TLS trust."""
    return channel(address, security.keys.first, security.channel_credentials())


def security_aio_channel(address: str, security: GrpcSecurity) -> grpc.aio.Channel:
    return aio_channel(address, security.keys.first, security.channel_credentials())


def is_serving(ch: grpc.Channel, timeout: float = 1.0, service: str = "") -> bool:
    """One grpc.health.v1 Check of ``service``; False for NOT_SERVING, unknown, unreachable or slow."""
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
