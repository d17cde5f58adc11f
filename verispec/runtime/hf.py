"""The transformers runner: any croppable-cache causal LM through its own modelling code.

Its cache keeps full-attention layers in preallocated buffers (`PreallocatedLayer`), so a step
writes only its new positions and a rollback is moving a length.

Models that verispec loads itself run the attention `grouped_sdpa()` names: transformers' SDPA
attention, except that grouped-query models hand torch their KV heads as they are. Stock SDPA
copies every KV head once per query head whenever a pass has a mask, which a verification
pass over a cache always has; the option is the model's (`attn_implementation` at load), so
models a caller brings keep theirs and nothing changes process-wide.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verispec.runtime.runner import PrefixRunner

GROUPED_SDPA = "verispec_grouped_sdpa"


class HFRunner(PrefixRunner):
    """One sequence (batch 1) of a transformers causal LM with a croppable DynamicCache."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(device=next(model.parameters()).device,
                         vocab_size=int(model.get_output_embeddings().weight.shape[0]),
                         max_positions=_max_positions(model.config))
        self.model = model.eval()
        self._growth_limit: int | None = None  # limit_growth's
        self._cache = new_cache(model.config)
        if not self._cache.is_croppable:
            raise ValueError(
                f"{type(model).__name__} uses a cache that cannot be rolled back (sliding "
                "window or recurrent state); speculative decoding needs a croppable KV cache")

    def describe(self) -> str:
        return f"hf {str(self.model.dtype).removeprefix('torch.')}"

    def sibling(self) -> HFRunner:
        """Another sequence on the same model, with its own cache."""
        return HFRunner(self.model)

    def limit_growth(self, positions: int | None) -> None:
        """Runner.limit_growth: the preallocated layers' buffers, now and after a reset."""
        self._growth_limit = positions
        _limit_layers(self._cache, self.model.config, positions)

    @property
    def bytes_per_position(self) -> int:
        """Runner.bytes_per_position: keys and values of every layer, from the config."""
        config = getattr(self.model.config, "text_config", None) or self.model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return (config.num_hidden_layers * kv_heads * head_dim * 2 *
                torch.empty((), dtype=self.model.dtype).element_size())

    @property
    def cache_bytes(self) -> int:
        """Runner.cache_bytes: the storage under every tensor the cache's layers hold (a
        PreallocatedLayer's whole buffers, not the views of its first positions; a recurrent
        layer's states), each storage once; a reset drops them."""
        storages = {}
        for layer in self._cache.layers:
            for value in vars(layer).values():
                values = value.values() if isinstance(value, dict) else (
                    value if isinstance(value, list | tuple) else (value,))
                for tensor in values:
                    if isinstance(tensor, torch.Tensor):
                        storage = tensor.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, num_logits: int = 1,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        if parents is not None:
            raise ValueError("token trees need the native runtime (--runtime native or auto)")
        keep = self.prepare(ids, num_logits)
        logits = self._forward(ids[keep:], keep, num_logits)
        self.commit(ids)
        return logits

    def _forward(self, new_ids: torch.Tensor, start: int, num_logits: int) -> torch.Tensor:
        """new_ids [T] at positions start.. -> logits [num_logits, V] of the last positions."""
        out = self.model(input_ids=new_ids.to(self.device).unsqueeze(0), cache=self._cache,
                         use_cache=True, logits_to_keep=num_logits)
        return out.logits[0, -num_logits:]

    def _truncate(self, length: int) -> None:
        self._cache.crop(length - self.cached_length)

    def _clear(self) -> None:
        self._cache = new_cache(self.model.config)
        _limit_layers(self._cache, self.model.config, self._growth_limit)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer [B, H, capacity, D] that doubles when full.

    transformers' DynamicLayer concatenates the whole cache on every step (O(length) copies per
    token); here a step writes only its new positions, and rolling back is moving `length`.
    """

    max_positions = 1 << 30  # what it grows to at most: the context, or less (_limit_layers)
    context = 1 << 30  # the model's context (_limit_layers)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        first = min(256, self.max_positions)  # update grows it where the first pass needs more
        self._key_buffer = _empty_like_with_length(key_states, first)
        self._value_buffer = _empty_like_with_length(value_states, first)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            # doubling, but never past the model's context or a memory bound's price (a
            # sequence longer than its price grows as without one)
            ceiling = self.max_positions if end <= self.max_positions else self.context
            capacity = max(end, min(2 * self._key_buffer.shape[-2], ceiling))
            self._key_buffer = self._grown(self._key_buffer, capacity)
            self._value_buffer = self._grown(self._value_buffer, capacity)
        self._key_buffer[..., self.length:end, :] = key_states
        self._value_buffer[..., self.length:end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of positions to remove")
        if self.is_initialized:
            self._set_length(self.length + tokens_to_remove)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[..., :length, :]  # [B, H, length, D] views, no copies
        self.values = self._value_buffer[..., :length, :]

    def _grown(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = _empty_like_with_length(buffer, capacity)
        grown[..., : self.length, :] = buffer[..., : self.length, :]
        return grown


def _empty_like_with_length(states: torch.Tensor, length: int) -> torch.Tensor:
    return states.new_empty(*states.shape[:-2], length, states.shape[-1])


def new_cache(config) -> DynamicCache:
    """A DynamicCache whose full-attention layers are preallocated; models with other layer
    kinds (sliding windows, recurrent states) keep transformers' own layers."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [PreallocatedLayer() for _ in cache.layers]
        _limit_layers(cache, config, None)
    return cache


def _limit_layers(cache: DynamicCache, config, positions: int | None) -> None:
    """The positions a cache's preallocated layers grow to at most: the model's context, or
    fewer (Runner.limit_growth)."""
    context = _max_positions(config)
    limit = context if positions is None else max(1, min(context, positions))
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.max_positions, layer.context = limit, context


def _max_positions(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


@functools.cache
def grouped_sdpa() -> str:
    """The `attn_implementation` name of `grouped_sdpa_attention` (registered with transformers
    on the first call, beside its own implementations; it changes no other model)."""
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks SDPA takes
    return GROUPED_SDPA


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs
                           ) -> tuple[torch.Tensor, None]:
    """query [B, nh, T, d], key and value [B, nkv, S, d] -> (attended [B, T, nh, d], None), as
    transformers' SDPA attention computes it, with torch's SDPA reading each KV head for its
    nh / nkv query heads in place (enable_gqa). Models without grouped heads, and attention
    with a position bias or a softcap, go to transformers' own function unchanged."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # Without a mask, a pass of several queries is causal from slot 0 (a prompt on an empty
    # cache): transformers leaves the mask out exactly then.
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    attended = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                              dropout_p=dropout, scale=scaling,
                                              is_causal=is_causal, enable_gqa=True)
    return attended.transpose(1, 2).contiguous(), None
