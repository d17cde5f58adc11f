"""A causal LM with its KV cache: feed only the tokens the cache lacks, roll back on rejection.

`CachedModel.logits(ids, num_logits)` keeps the cache in sync with any token sequence: it keeps
the longest cached prefix that `ids` shares (the rollback), feeds the rest in one forward pass,
and returns the logits of the last `num_logits` positions. A speculative round is then
  target.logits(history + draft, num_logits=len(draft) + 1)
and the rejected draft tokens simply fall out of the cache at the next call.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from verispec.loading import DTYPES

log = logging.getLogger("verispec")


class CachedModel:
    """One sequence (batch 1) of an HF causal LM with a croppable DynamicCache.

    Subclasses for other backends (verispec.native) override `_forward`, `_truncate` and
    `reset`; the prefix bookkeeping stays here.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = _max_positions(model.config)
        self._cache = new_cache(model.config)
        if not self._cache.is_croppable:
            raise ValueError(
                f"{type(model).__name__} uses a cache that cannot be rolled back (sliding "
                "window or recurrent state); speculative decoding needs a croppable KV cache")
        self._cached_ids = torch.empty(0, dtype=torch.long)  # the tokens whose KV is cached
        self.forward_calls = 0

    def reset(self) -> None:
        self._cache = new_cache(self.model.config)
        self._cached_ids = torch.empty(0, dtype=torch.long)

    def describe(self) -> str:
        return f"hf {str(self.model.dtype).removeprefix('torch.')}"

    def sibling(self) -> CachedModel:
        """Another sequence on the same model, with its own cache."""
        return CachedModel(self.model)

    @property
    def cached_ids(self) -> torch.Tensor:
        """[cached_length] long: the tokens whose keys and values the cache holds."""
        return self._cached_ids

    @property
    def cached_length(self) -> int:
        return int(self._cached_ids.numel())

    def rollback(self, length: int) -> None:
        """Drop the cached positions from `length` on."""
        if self.cached_length > length:
            self._truncate(length)
            self._cached_ids = self._cached_ids[:length]

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, num_logits: int = 1,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """ids [L] (cpu long) -> logits [num_logits, V] for the last num_logits positions.

        Example: cache holds [a, b, c, x]; ids = [a, b, c, y, z], num_logits = 2 -> rollback to
        [a, b, c], feed [y, z], return the logits after y and after z.
        parents: the last num_logits - 1 ids are a token tree (native runtime only).
        """
        if parents is not None:
            raise ValueError("token trees need the native runtime (--runtime native or auto)")
        keep = self.prepare(ids, num_logits)
        logits = self._forward(ids[keep:], keep, num_logits)
        self.commit(ids)
        return logits

    def prepare(self, ids: torch.Tensor, num_logits: int) -> int:
        """Check a pass over ids and roll the cache back to the longest cached prefix, leaving at
        least num_logits positions to feed; return that prefix length."""
        length = int(ids.numel())
        if not 1 <= num_logits <= length:
            raise ValueError(f"num_logits must be in [1, {length}], got {num_logits}")
        if length > self.max_positions:
            raise ValueError(f"sequence of {length} tokens exceeds the model's context of "
                             f"{self.max_positions}")
        keep = min(common_prefix(self._cached_ids, ids), length - num_logits)
        self.rollback(keep)
        return keep

    def commit(self, ids: torch.Tensor) -> None:
        """After the forward pass: the cache now holds all of ids."""
        self.forward_calls += 1
        self._cached_ids = ids.clone()

    def _forward(self, new_ids: torch.Tensor, start: int, num_logits: int) -> torch.Tensor:
        """new_ids [T] at positions start.. -> logits [num_logits, V] of the last positions."""
        out = self.model(input_ids=new_ids.to(self.device).unsqueeze(0), cache=self._cache,
                         use_cache=True, logits_to_keep=num_logits)
        return out.logits[0, -num_logits:]

    def _truncate(self, length: int) -> None:
        self._cache.crop(length - self.cached_length)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer [B, H, capacity, D] that doubles when full.

    transformers' DynamicLayer concatenates the whole cache on every step (O(length) copies per
    token); here a step writes only its new positions, and rolling back is moving `length`.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._key_buffer = _empty_like_with_length(key_states, 256)
        self._value_buffer = _empty_like_with_length(value_states, 256)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            capacity = max(end, 2 * self._key_buffer.shape[-2])
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
    return cache


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def _max_positions(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def batched_logits(runners: list[CachedModel], sequences: list[torch.Tensor],
                   num_logits: list[int], parents: list[torch.Tensor | None] | None = None
                   ) -> list[torch.Tensor]:
    """runner.logits(ids, n[, parents]) for many sequences: one forward pass when the runners
    are native runners of one model, one pass per sequence otherwise (transformers' runtime
    keeps each sequence in its own cache). Either way a row's logits equal what it gets alone."""
    from verispec.native import NativeCachedModel
    from verispec.native import batched_logits as native_batched

    parents = parents or [None] * len(runners)
    if runners and all(isinstance(r, NativeCachedModel) and r.model is runners[0].model
                       for r in runners):
        return native_batched(runners, sequences, num_logits, parents)
    return [runner.logits(ids, n, p)
            for runner, ids, n, p in zip(runners, sequences, num_logits, parents, strict=True)]


RUNTIMES = ("auto", "hf", "native")


def make_runner(model: PreTrainedModel, runtime: str = "auto", dtype: str = "auto",
                int8: bool = False) -> CachedModel:
    """The runner for `model`: "native" (verispec's Llama runtime, verispec.native), "hf"
    (transformers' modelling code) or "auto" (native for the architectures it supports, with
    a logged note when it falls back to hf).

    dtype "auto" keeps the model's dtype on hf and takes bfloat16 on the native runtime on a CPU,
    where it is both faster and batch-invariant (speculative greedy equals plain greedy);
    another dtype converts the native weights (the hf model is used as loaded). Models in other
    dtypes (float64) stay on hf under "auto".
    int8: weight-only int8 linear layers, native runtime only.
    """
    from verispec.native import NativeCachedModel, NativeLlama, UnsupportedModelError

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    if runtime == "hf":
        if int8:
            raise ValueError("int8 weights need the native runtime (--runtime native or auto)")
        return CachedModel(model)
    device, model_dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if dtype == "auto" and model_dtype not in DTYPES.values():
        if runtime == "native":
            raise ValueError(f"the native runtime runs {', '.join(DTYPES)}, not {model_dtype}")
        return CachedModel(model)
    if dtype != "auto":
        native_dtype = DTYPES[dtype]
    elif device.type == "cpu" or int8:
        native_dtype = torch.bfloat16
    else:
        native_dtype = model_dtype
    try:
        return NativeCachedModel(NativeLlama.from_hf(model, native_dtype, int8=int8))
    except UnsupportedModelError as err:
        if runtime == "native" or int8:
            raise
        log.info("native runtime unavailable (%s): using transformers' modelling code", err)
        return CachedModel(model)
