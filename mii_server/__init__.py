"""mii-server: an MII-style model server for causal language models.

``pipeline()`` runs the engine in this process; ``serve()`` stands up a deployment and returns a
client; ``client()`` finds a running one. Heavy modules (torch, the engine) load only when used, so
clients and gateways start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import UnknownArgument
from .generation.response import FinishReason, Response

if TYPE_CHECKING:
    from .in_process import Pipeline

__all__ = ["FinishReason", "Response", "UnknownArgument", "pipeline"]


def pipeline(model_name_or_path: str = "", **model_kwargs: Any) -> Pipeline:
    """Load a model into this process; see ``mii_server.in_process.pipeline``."""
    from .in_process import pipeline as _pipeline

    return _pipeline(model_name_or_path, **model_kwargs)
