"""verispec: lossless speculative decoding.

    from verispec import SpeculativeDecoder, SamplingParams
    dec = SpeculativeDecoder.from_pretrained(target=None, draft="default", k="auto")
    out = dec.generate("Explain KV caches.", SamplingParams(max_new_tokens=128))
    out.text, out.token_ids, out.stats
"""

import os

# verispec never downloads: models are local folders, .gguf files or the embedded default.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Let torch's SDPA handle grouped-query attention natively instead of transformers repeating the
# KV heads: a multi-token verification pass at 1.3k context got ~13% faster on CPU (measured).
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

from verispec.decoder import GenerationOutput, SpeculativeDecoder, StreamChunk
from verispec.params import SamplingParams
from verispec.stats import GenerationStats

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamChunk",
]
__version__ = "0.1.0"
