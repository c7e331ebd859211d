"""The one place that maps typed errors to gRPC status codes and HTTP statuses, and back.

Servers (``grpc.aio``) await :func:`abort_rpc` (or call :func:`grpc_status_of`) with a caught exception; clients call
:func:`error_from_rpc` on a ``grpc.RpcError`` and get the same exception type the server raised,
carrying the server's message. The type travels in trailing metadata (``mii-error``) because several
types share one status code.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from .. import errors

ERROR_METADATA_KEY = "mii-error"

# Error type -> (gRPC code, HTTP status). Order matters only for subclasses (none overlap here).
_TABLE: dict[type[errors.MIIServerError], tuple[grpc.StatusCode, int]] = {
    errors.UnknownArgument: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    errors.ContextLengthExceeded: (grpc.StatusCode.INVALID_ARGUMENT, 400),  # before its base class
    errors.InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    errors.UnsupportedModel: (grpc.StatusCode.FAILED_PRECONDITION, 400),
    errors.CapacityExceeded: (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    errors.DeploymentNotFound: (grpc.StatusCode.NOT_FOUND, 404),
    errors.Unauthorized: (grpc.StatusCode.UNAUTHENTICATED, 401),
    errors.Forbidden: (grpc.StatusCode.PERMISSION_DENIED, 403),
    errors.DeploymentStartError: (grpc.StatusCode.INTERNAL, 500),
    errors.ReplicaUnavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    errors.EngineDead: (grpc.StatusCode.UNAVAILABLE, 503),
}
_BY_NAME: dict[str, type[errors.MIIServerError]] = {cls.__name__: cls for cls in _TABLE}

# Codes with no error name attached (transport failures, foreign servers) -> what the caller sees.
_FALLBACK: dict[grpc.StatusCode, type[errors.MIIServerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityExceeded,
    grpc.StatusCode.NOT_FOUND: errors.DeploymentNotFound,
    grpc.StatusCode.UNAVAILABLE: errors.ReplicaUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthorized,
    grpc.StatusCode.PERMISSION_DENIED: errors.Forbidden,
}


def _classify(exc: BaseException) -> tuple[type[errors.MIIServerError] | None, grpc.StatusCode, int]:
    for cls, (code, http) in _TABLE.items():
        if isinstance(exc, cls):
            return cls, code, http
    return None, grpc.StatusCode.INTERNAL, 500


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    return _classify(exc)[1]


def http_status_of(exc: BaseException) -> int:
    """HTTP status for an error: 400 bad request, 404, 503 overloaded/unavailable, 500 otherwise."""
    return _classify(exc)[2]


def error_name_of(exc: BaseException) -> str:
    cls = _classify(exc)[0]
    return cls.__name__ if cls is not None else "InternalError"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, details, error name or None) of the status a call ends with for ``exc``."""
    cls, code, _ = _classify(exc)
    if cls is not None:
        return code, str(exc), cls.__name__
    return code, f"internal error: {type(exc).__name__}: {exc}", None


async def abort_rpc(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the current RPC with the status that ``exc`` maps to (raises, as ``context.abort`` does)."""
    code, details, name = status_of(exc)
    await context.abort(code, details, trailing_metadata=((ERROR_METADATA_KEY, name),) if name else ())
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def rpc_status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, details, error name or None) of a failed call."""
    return _code_of(err), _details_of(err), _error_name_from_metadata(err)


async def forward_rpc_error(context: grpc.aio.ServicerContext, err: grpc.RpcError) -> NoReturn:
    """Re-raise an upstream RPC's failure to our own caller with the same code, message and type."""
    code, details, name = rpc_status(err)
    metadata = ((ERROR_METADATA_KEY, name),) if name is not None else ()
    await context.abort(code, details, trailing_metadata=metadata)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def error_from_rpc(err: grpc.RpcError, where: str = "") -> errors.MIIServerError:
    """The typed exception a failed RPC stands for, with the server's message (client side)."""
    code = _code_of(err)
    details = _details_of(err)
    name = _error_name_from_metadata(err)
    if name in _BY_NAME:
        return _BY_NAME[name](details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.ReplicaUnavailable(
            f"deployment{' at ' + where if where else ''} is unreachable: {details}"
        )
    cls = _FALLBACK.get(code, errors.MIIServerError)
    return cls(f"{code.name}: {details}")


class RemoteError(grpc.RpcError):
    """A call's failure that arrived as data (a multiplexed stream's error event) or was decided
    locally (a hung replica); it reads as a failed call does (``code``, ``details``,
    ``trailing_metadata``), so ``is_retryable``, ``forward_rpc_error`` and ``error_from_rpc`` take it."""

    def __init__(self, code: grpc.StatusCode, details: str, error_name: str | None = None) -> None:
        super().__init__(details)
        self._code, self._details, self._error_name = code, details, error_name

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        """The status ``abort_rpc`` would end a call with for ``exc``."""
        return cls(*status_of(exc))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((ERROR_METADATA_KEY, self._error_name),) if self._error_name else ()


def is_transport_failure(err: grpc.RpcError) -> bool:
    """UNAVAILABLE that no server of ours decided (no error name): the peer could not be reached, or the
    connection to it dropped. A request that got no output yet may be sent again once the peer answers."""
    return _code_of(err) == grpc.StatusCode.UNAVAILABLE and _error_name_from_metadata(err) is None


def is_retryable(err: grpc.RpcError) -> bool:
    """True for failures that say nothing was done (replica down or dying): safe to send elsewhere."""
    return _code_of(err) == grpc.StatusCode.UNAVAILABLE


def _code_of(err: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(err, "code", None)
    return code() if callable(code) else grpc.StatusCode.UNKNOWN


def _details_of(err: grpc.RpcError) -> str:
    details = getattr(err, "details", None)
    return (details() if callable(details) else None) or str(err)


def _error_name_from_metadata(err: grpc.RpcError) -> str | None:
    trailing = getattr(err, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    for key, value in metadata or ():
        if key == ERROR_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None
