"""InjectedDecoder: stands in for a llama-family base model (``LlamaModel``...) inside its ``...ForCausalLM``.

It takes the base model's forward arguments (input ids or embeddings, the 2D attention mask,
position ids, the cache under transformers' name of the day, ``cache`` or ``past_key_values``) and
returns its ``BaseModelOutputWithPast``, so the model's own forward, LM head and ``generate`` run
unchanged around it. Inside: the model's embedding, then mii_server's decoder layers
(``models.llama.LlamaDecoderLayer``: fused RMSNorm + residual, rotary + KV append, paged attention)
and final RMSNorm over a ``KVPool`` of its own, instead of transformers' mask building, rotary module
and concatenating cache.

Caches: an ``InjectedCache`` continues; an empty transformers cache (the one ``generate`` makes
before its first step) or none with ``use_cache`` starts a new generation in the shared pool, which
is returned as the output's cache; ``use_cache=False`` uses a pool of its own for that one forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..engine.kv_cache import BlockedKVCache
from ..errors import InvalidRequest
from ..models.spec import ArchitectureSpec
from .batch import decode_metadata, prefill_metadata
from .kv_cache import InjectedCache, KVPool

log = logging.getLogger(__name__)

# transformers 5.17 names the cache past_key_values; later versions name it cache
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
BLOCK_SIZE = 64  # KV slots per block of the pool


class InjectedDecoder(nn.Module):
    """Embedding -> our decoder layers -> final norm, over the pool; see the module docstring."""

    def __init__(
        self,
        config: Any,
        spec: ArchitectureSpec,
        embed_tokens: nn.Module,
        layers: nn.ModuleList,
        norm: nn.Module,
        cos_sin: torch.Tensor,  # float32 [max_positions, head_dim]
        max_out_tokens: int,
    ) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.capacity = min(max_out_tokens, spec.max_positions)
        self.pool: KVPool | None = None  # shared by generations, grown for larger batches
        self.graphs: Any = None  # cuda_graph.DecodeGraphs when enable_cuda_graph is on

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    # ---- pools and caches ------------------------------------------------------------------------
    def _new_pool(self, rows: int, capacity: int) -> KVPool:
        attn = self.layers[0].self_attn
        blocks = KVPool.blocks_needed(rows, capacity, BLOCK_SIZE)
        with torch.inference_mode(False):  # see KVPool
            storage = BlockedKVCache(self.spec.num_layers, blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim,
                                     self.norm.weight.dtype, self.cos_sin.device)  # fmt: skip
            return KVPool(storage, rows, capacity)

    def shared_pool(self, rows: int) -> KVPool:
        """The pool generations share, reallocated when a batch has more rows than it (or it moved)."""
        pool = self.pool
        if pool is None or pool.rows < rows or pool.lengths.device != self.cos_sin.device:
            self.pool = None  # why first: free the old storage before the new one is allocated
            if self.graphs is not None:
                self.graphs.reset()  # they read the old storage
            self.pool = self._new_pool(rows, self.capacity)
            log.info("injected KV cache: %d rows x %d tokens", rows, self.pool.capacity)
        return self.pool

    def _cache_for(self, cache: Any, batch: int, length: int, use_cache: bool) -> InjectedCache:
        if isinstance(cache, InjectedCache):
            cache.check_live(batch)
            return cache
        if cache is not None and cache.get_seq_length() > 0:
            raise InvalidRequest(
                f"a {type(cache).__name__} filled outside the kernel-injected model cannot be continued: "
                "it keeps its own KV cache (pass the cache this model returned, or none)"
            )
        if not use_cache:  # one forward, nothing kept: a pool exactly this long, not the shared one
            return self._new_pool(batch, length).start(batch)
        return self.shared_pool(batch).start(batch)

    # ---- the forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Any = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """The base model's forward; returns hidden states [B, L, hidden] (zeros at padding)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidRequest("give exactly one of input_ids and inputs_embeds")
        if output_attentions or output_hidden_states:
            raise InvalidRequest(
                "the kernel-injected decoder returns neither attentions nor per-layer hidden states"
            )
        cache = cache if cache is not None else past_key_values
        use_cache = bool(self.config.use_cache if use_cache is None else use_cache)
        inputs = input_ids if input_ids is not None else inputs_embeds
        batch, length = inputs.shape[:2]
        keep = self._new_token_mask(attention_mask, batch, length, inputs.device)
        kv = self._cache_for(cache, batch, length, use_cache)
        if position_ids is None:  # transformers' default: the cache length (padding included) onwards
            if kv.seen + length > self.spec.max_positions:
                raise InvalidRequest(
                    f"position {kv.seen + length - 1} is beyond the model's {self.spec.max_positions}"
                )
            positions = (torch.arange(length, device=inputs.device) + kv.seen).expand(batch, length)
        else:
            positions = position_ids.to(torch.int64).expand(batch, length)
        if length == 1 and input_ids is not None:
            kv.reserve(1)
            mask = keep.view(batch).to(torch.int32)
            hidden = self.decode(kv, input_ids.reshape(batch), positions.reshape(batch), mask).unsqueeze(1)
            kv.longest += 1
        else:
            hidden = self._prefill(kv, input_ids, inputs_embeds, keep, positions)
        kv.seen += length
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_FIELD: kv if use_cache else None})

    @staticmethod
    def _new_token_mask(
        mask: torch.Tensor | None, batch: int, length: int, device: torch.device
    ) -> torch.Tensor:
        """bool [B, L]: which new columns are real tokens (transformers' masks span past and new columns)."""
        if mask is None:
            return torch.ones(batch, length, dtype=torch.bool, device=device)
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < length:
            raise InvalidRequest(
                f"the kernel-injected decoder takes a 2D attention mask [batch, past + new columns], not "
                f"{tuple(mask.shape)} for inputs of {batch} x {length}"
            )
        return mask[:, -length:].to(device=device, dtype=torch.bool)

    def _prefill(
        self,
        kv: InjectedCache,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        keep: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        meta = prefill_metadata(kv, keep, positions, self.spec.max_positions)
        x = (
            self.embed_tokens(input_ids[keep]) if input_ids is not None else inputs_embeds[keep]
        )  # [T, hidden]
        h = self.run_layers(x, meta, kv.pool)
        out = h.new_zeros(*keep.shape, h.shape[-1])  # [B, L, hidden]
        out[keep] = h
        return out

    def decode(
        self, kv: InjectedCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One token per row (ids, positions [B]; mask int32 [B]) -> hidden states [B, hidden]."""
        if self.graphs is not None and kv.pool is self.pool:
            return self.graphs.run(kv.pool, ids, positions, mask)
        return self.decode_step(kv.pool, ids, positions, mask)

    def decode_step(
        self, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The one-token step over the pool's first B rows, with no host synchronisation (what the
        CUDA graphs capture): attention over each row's tokens, then each row's length += mask."""
        meta = decode_metadata(pool, mask, positions)
        h = self.run_layers(self.embed_tokens(ids), meta, pool)
        pool.lengths[: ids.shape[0]] += mask
        return h

    def run_layers(self, x: torch.Tensor, meta: Any, pool: KVPool) -> torch.Tensor:
        """[T, hidden] embeddings -> [T, hidden] final-normed hidden states, caching K and V in ``pool``."""
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = pool.layer(i)
            x, residual = layer(x, residual, meta, self.cos_sin, k_cache, v_cache)
        x, _ = self.norm(x, residual)
        return x
