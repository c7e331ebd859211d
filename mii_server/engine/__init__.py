"""The inference engine: blocked KV cache, sequence state and ragged forward passes (no policy)."""

from .allocator import BlockedAllocator
from .engine import InferenceEngine, SchedulingResult
from .kv_cache import BlockedKVCache
from .prefix_cache import PrefixCache
from .ragged_batch import RaggedBatch
from .state_manager import SequenceDescriptor, StateManager

__all__ = [
    "BlockedAllocator",
    "BlockedKVCache",
    "InferenceEngine",
    "PrefixCache",
    "RaggedBatch",
    "SchedulingResult",
    "SequenceDescriptor",
    "StateManager",
]
