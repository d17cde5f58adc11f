"""verispec's own runtime for Llama-family models: preallocated KV cache, fused weights, and a
forward whose result for a position does not depend on how many positions the pass holds."""

from verispec.native.llama import KVCache, LlamaShape, NativeLlama, UnsupportedModelError
from verispec.native.runner import NativeCachedModel, batched_logits

__all__ = ["KVCache", "LlamaShape", "NativeCachedModel", "NativeLlama", "UnsupportedModelError",
           "batched_logits"]
