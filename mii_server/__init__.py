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


def pipeline(model_name_or_path: str = "", all_rank_output: bool = False, **model_kwargs: Any) -> Pipeline:
    """Load a model into this process; see ``mii_server.in_process.pipeline``."""
    from .in_process import pipeline as _pipeline

    return _pipeline(model_name_or_path, all_rank_output=all_rank_output, **model_kwargs)


if TYPE_CHECKING:
    from .inference import InferenceEngine

__all__ += ["init_inference"]


def init_inference(model: Any, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Wrap a transformers model in our kernels, tensor parallelism and CUDA graphs, as DeepSpeed's
    ``init_inference`` does; see ``mii_server.inference.engine.init_inference``."""
    from .inference import init_inference as _init_inference

    return _init_inference(model, config, **kwargs)


# ---- deployments (mii_server.serving.control.api; imports no torch) ----------------------------
if TYPE_CHECKING:
    from .serving.frontends.client import Client

__all__ += ["client", "serve"]


def serve(model_name_or_path: str = "", **kwargs: Any) -> Client:
    """Start a deployment and return its client; see ``mii_server.serving.control.api.serve``."""
    from .serving.control.api import serve as _serve

    return _serve(model_name_or_path, **kwargs)


def client(
    deployment_name_or_host_port: str = "", timeout: float | None = None, api_key: str | None = None
) -> Client:
    """A client for a running deployment; see ``mii_server.serving.control.api.client``."""
    from .serving.control.api import client as _client

    return _client(deployment_name_or_host_port, timeout=timeout, api_key=api_key)
