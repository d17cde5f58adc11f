"""`verispec distill`: train a small draft on data the target writes itself.

    from verispec.distill import DistillConfig, distill
    result = distill(DistillConfig(out="runs/smol", target=None))
    # then: SpeculativeDecoder.from_pretrained(target=None, draft=result.draft)

Modules: training_prompts (verispec's own prompt list, self-prompts), data (responses and the
target's top-k log-probabilities, in shards), lm_draft (the small LM draft), feature_head (the
EAGLE-style feature draft), train (KL training, checkpoints), pipeline (the whole run).
The folder a run writes is `verispec.drafters.folder`'s: inference reads it from there and never
imports this package.
"""

from verispec.distill.distill_config import DistillConfig
from verispec.distill.pipeline import DistillResult, distill

__all__ = ["DistillConfig", "DistillResult", "distill"]
