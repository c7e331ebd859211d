"""Who may call what: API keys, the deployment's admin token, and TLS, for gRPC and HTTP alike.

- **API keys** (``$MII_SERVER_API_KEY``, comma-separated, and ``api_key_file``, one per line; never
  argv): once any key is configured, every Generation RPC needs ``authorization: Bearer KEY`` metadata
  and every HTTP route but the probes ``Authorization: Bearer KEY``. Processes of the deployment send
  the first key to each other; a client sends ``Client(api_key=...)`` or ``$MII_SERVER_API_KEY``.
- **The admin token** (``$MII_SERVER_ADMIN_TOKEN``): ``Terminate`` needs ``x-mii-admin-token``
  whether or not keys are set, and needs nothing else (the token outranks a key). ``serve()`` and ``mii-server serve`` make a fresh one per deployment,
  hand it to its processes by environment and keep it in the owner-only registry record, so the
  owner's ``client(name).terminate_server()`` and ``mii-server stop`` work and nobody else's do. A
  process with no token refuses every ``Terminate`` (a Kubernetes pod is stopped by Kubernetes).
- **TLS** (``tls_cert_file`` + ``tls_key_file`` on the servers, ``tls_ca_file`` to trust them): for
  deployments that bind beyond loopback; every gRPC hop then uses it.

Keys and tokens are compared in constant time (``hmac.compare_digest``), each configured key every
time, so timing reveals neither a key nor which one matched.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..errors import Forbidden, InvalidRequest, Unauthorized
from .status import abort_rpc

API_KEY_ENV = "MII_SERVER_API_KEY"
ADMIN_TOKEN_ENV = "MII_SERVER_ADMIN_TOKEN"
AUTHORIZATION = "authorization"
ADMIN_TOKEN_METADATA = "x-mii-admin-token"
_PROTECTED_SERVICE = "/mii_server.wire.Generation/"  # grpc.health.v1 stays open: probes need no key
_ADMIN_METHODS = frozenset({_PROTECTED_SERVICE + "Terminate"})
_STREAMING_METHODS = frozenset({_PROTECTED_SERVICE + "GenerateStream"})
_BIDIRECTIONAL_METHODS = frozenset({_PROTECTED_SERVICE + "GenerateMultiplexed"})


class ApiKeys:
    """The accepted API keys; none means no authentication. Keys come from the environment or a file,
    never from argv (command lines are visible to every user of the machine and land in logs)."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def load(cls, key_file: str = "", environ: dict[str, str] | None = None) -> ApiKeys:
        """Keys from ``$MII_SERVER_API_KEY`` (comma-separated) and ``key_file`` (one per line, # comments)."""
        env = os.environ if environ is None else environ
        keys = [k.strip() for k in env.get(API_KEY_ENV, "").split(",")]
        if key_file:
            try:
                text = Path(key_file).read_text()
            except OSError as err:
                raise InvalidRequest(f"cannot read api_key_file {key_file!r}: {err}") from None
            keys += [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
        return cls([k for k in keys if k])

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def first(self) -> str:
        """The key this process presents to the others of its deployment ('' when none is set)."""
        return self._keys[0].decode() if self._keys else ""

    def allows(self, authorization: str | None) -> bool:
        """True for ``Bearer <a known key>`` (or when no key is configured)."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class GrpcSecurity:
    """How one process's gRPC servers check callers, and what its channels present."""

    keys: ApiKeys
    admin_token: str = ""  # what Terminate must present ('' : Terminate refused)
    tls_cert_file: str = ""  # server certificate chain (PEM); with tls_key_file, servers use TLS
    tls_key_file: str = ""
    tls_ca_file: str = ""  # certificates channels trust (PEM); set: channels use TLS

    @classmethod
    def load(cls, api_key_file: str = "", tls_cert_file: str = "", tls_key_file: str = "",
             tls_ca_file: str = "") -> GrpcSecurity:  # fmt: skip
        """This process's security from its config's files and the environment; channels trust
        ``tls_ca_file``, else (TLS on) the server certificate itself."""
        if bool(tls_cert_file) != bool(tls_key_file):
            raise InvalidRequest("TLS needs both tls_cert_file and tls_key_file")
        token = os.environ.get(ADMIN_TOKEN_ENV, "")
        return cls(ApiKeys.load(api_key_file), token, tls_cert_file, tls_key_file, tls_ca_file or tls_cert_file)

    # ---- server side -----------------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_CallerCheck(self.keys, self.admin_token)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on ``address``, with TLS when a certificate is configured."""
        if not self.tls_cert_file:
            return server.add_insecure_port(address)
        pair = (_read(self.tls_key_file), _read(self.tls_cert_file))
        return server.add_secure_port(address, grpc.ssl_server_credentials([pair]))

    # ---- client side -----------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        return trusting(self.tls_ca_file)

    def call_metadata(self, admin: bool = False) -> tuple[tuple[str, str], ...]:
        """Metadata of a call this process makes to another of its deployment."""
        return call_metadata(self.keys.first, self.admin_token if admin else "")


def trusting(ca_file: str) -> grpc.ChannelCredentials | None:
    """TLS channel credentials trusting the PEM certificates in ``ca_file`` (None: plaintext)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file)) if ca_file else None


def call_metadata(api_key: str = "", admin_token: str = "") -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    if api_key:
        out.append((AUTHORIZATION, f"Bearer {api_key}"))
    if admin_token:
        out.append((ADMIN_TOKEN_METADATA, admin_token))
    return tuple(out)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise InvalidRequest(f"cannot read {path!r}: {err}") from None


class _CallerCheck(grpc.aio.ServerInterceptor):
    """Refuses a Generation RPC without a known key (UNAUTHENTICATED), and Terminate without the admin
    token (PERMISSION_DENIED), before any handler runs."""

    def __init__(self, keys: ApiKeys, admin_token: str) -> None:
        self._keys = keys
        self._admin_token = admin_token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if not method.startswith(_PROTECTED_SERVICE):
            return await continuation(details)
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        if method in _ADMIN_METHODS and self._admin_ok(metadata.get(ADMIN_TOKEN_METADATA, "")):
            return await continuation(details)  # the owner's token is enough: `mii-server stop` needs no key
        if not self._keys.allows(metadata.get(AUTHORIZATION)):
            return _refusal(method, Unauthorized("missing or invalid API key: send 'authorization: Bearer <key>' metadata"))
        if method in _ADMIN_METHODS:
            return _refusal(method, Forbidden("Terminate needs this deployment's admin token (x-mii-admin-token)"))
        return await continuation(details)

    def _admin_ok(self, presented: str) -> bool:
        return bool(self._admin_token) and hmac.compare_digest(presented.encode(), self._admin_token)


def _refusal(method: str, exc: Exception) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, exc)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort_rpc(context, exc)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    if method in _STREAMING_METHODS:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if method in _BIDIRECTIONAL_METHODS:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


class _AioMetadata:
    """Adds fixed metadata (the API key) to the calls of an asyncio channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        merged = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self._metadata))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, merged, details.credentials,
                                          details.wait_for_ready)  # fmt: skip


# One class per call kind: grpc.aio files an interceptor under the first kind it is an instance of
# only, so one class serving both would never see the streaming calls.
class _AioUnaryMetadata(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamMetadata(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioBidirectionalMetadata(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the API key) to every call of a synchronous channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return _SyncDetails(details.method, details.timeout, tuple(details.metadata or ()) + self._metadata,
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


@dataclass(frozen=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str], ...]
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def aio_interceptors(api_key: str) -> list[Any]:
    if not api_key:
        return []
    metadata = call_metadata(api_key)
    return [_AioUnaryMetadata(metadata), _AioStreamMetadata(metadata), _AioBidirectionalMetadata(metadata)]


def intercepted(channel: grpc.Channel, api_key: str) -> grpc.Channel:
    return grpc.intercept_channel(channel, _SyncMetadata(call_metadata(api_key))) if api_key else channel
