"""verispec's own runtime for Llama-family models: preallocated KV cache, fused weights, and a
forward whose result for a position does not depend on how many positions the pass holds."""

from verispec.runtime.native.cache import KVCache
from verispec.runtime.native.llama import NativeLlama
from verispec.runtime.native.native_runner import NativeRunner, batched_logits
from verispec.runtime.native.shape import LlamaShape, UnsupportedModelError

__all__ = ["KVCache", "LlamaShape", "NativeLlama", "NativeRunner", "UnsupportedModelError",
           "batched_logits"]
