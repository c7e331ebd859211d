"""``init_inference``: wrap a Hugging Face transformers model in mii_server's kernels, tensor
parallelism and CUDA graphs, as DeepSpeed's ``deepspeed.init_inference`` does (see ``engine``)."""

from .config import InferenceConfig, TensorParallelConfig
from .engine import InferenceEngine, init_inference

__all__ = ["InferenceConfig", "InferenceEngine", "TensorParallelConfig", "init_inference"]
