"""Typed errors raised at the project's edges.

One place (``mii_server.serving.status``) maps these to gRPC status codes and HTTP statuses; clients
map them back, so a caller sees the same exception type whether it called ``pipeline()`` in process
or a deployment over the network.
"""

from __future__ import annotations


class MIIServerError(Exception):
    """Base of every error this package raises on purpose."""


class UnknownArgument(MIIServerError, TypeError):
    """A keyword argument that no config or generation parameter accepts."""


class InvalidRequest(MIIServerError, ValueError):
    """A request whose values are out of range (negative length, top_p > 1, prompt too long...)."""


class ContextLengthExceeded(InvalidRequest):
    """A prompt (with the tokens asked for) longer than the model's context or the request's max_length."""


class UnsupportedModel(MIIServerError, ValueError):
    """A checkpoint whose ``model_type`` no model family here implements."""


class CapacityExceeded(MIIServerError, RuntimeError):
    """The engine was asked to hold more tokens, sequences or KV blocks than it has room for."""


class DeploymentNotFound(MIIServerError, LookupError):
    """No running deployment answers to the given name or address."""


class DeploymentStartError(MIIServerError, RuntimeError):
    """A process of the deployment failed to start; the message carries the tail of its log."""


class ReplicaUnavailable(MIIServerError, RuntimeError):
    """No replica could take the request (all down or draining)."""


class EngineDead(MIIServerError, RuntimeError):
    """The engine stopped (a rank died, or it was destroyed) and can take no more requests."""


class Unauthorized(MIIServerError, PermissionError):
    """The caller presented no API key, or an unknown one, where one is required."""


class Forbidden(MIIServerError, PermissionError):
    """The caller is not allowed this call (Terminate without the deployment's admin token)."""


class UntrustedRegistry(MIIServerError, PermissionError):
    """The registry directory or a record in it is not this user's alone (another user could plant one)."""
