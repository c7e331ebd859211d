"""Model families, dispatched by config.json's model_type."""

from .loader import LoadedModel, load_model, resolve_model_path
from .registry import MODEL_FAMILIES, model_class_for

__all__ = ["MODEL_FAMILIES", "LoadedModel", "load_model", "model_class_for", "resolve_model_path"]
