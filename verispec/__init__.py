"""verispec: lossless speculative decoding.

    from verispec import SpeculativeDecoder, SamplingParams
    dec = SpeculativeDecoder.from_pretrained(target=None, draft="default", k="auto")
    out = dec.generate("Explain KV caches.", SamplingParams(max_new_tokens=128))
    out.text, out.token_ids, out.stats
"""

from verispec.decoder import GenerationOutput, SpeculativeDecoder, StreamChunk
from verispec.params import SamplingParams
from verispec.stats import GenerationStats
from verispec.version import installed_version

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamChunk",
]
__version__ = installed_version()
