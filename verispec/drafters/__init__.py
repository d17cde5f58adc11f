"""Drafters propose the next tokens cheaply; the target then verifies them in one pass.

Every drafter follows one protocol, `Drafter.propose(history, k, params, generator) -> Draft`:
given all tokens so far (prompt + output), propose up to k tokens. A draft may carry the
probabilities it sampled from (a draft model) or none (deterministic, as n-gram lookup). A
drafter that reads the target's hidden states (`FeatureDrafter`) also has `follow(runner)`,
which the decoder and the scheduler call with the target runner of the same sequence.
"""

from verispec.drafters.drafter import Draft, Drafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.suffix import SuffixDrafter

__all__ = ["Draft", "Drafter", "FeatureDrafter", "HybridDrafter", "ModelDrafter", "NgramDrafter",
           "SuffixDrafter"]
