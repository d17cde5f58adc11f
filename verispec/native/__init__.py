"""verispec's own runtime for Llama-family models: preallocated KV cache, fused weights, and a
forward whose result for a position does not depend on how many positions the pass holds."""

from verispec.native.llama import LlamaShape, NativeLlama, UnsupportedModelError
from verispec.native.runner import NativeCachedModel

__all__ = ["LlamaShape", "NativeCachedModel", "NativeLlama", "UnsupportedModelError"]
