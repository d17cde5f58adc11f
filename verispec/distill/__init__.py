"""`verispec distill`: train a small draft on data the target writes itself.

    from verispec.distill import DistillConfig, distill
    result = distill(DistillConfig(out="runs/smol", target=None))
    # then: SpeculativeDecoder.from_pretrained(target=None, draft=result.draft)

Modules: prompts (verispec's own prompt list, self-prompts), data (responses and the target's
top-k log-probabilities, in shards), model (the draft, its folder, load_draft), train (KL
training, checkpoints), pipeline (the whole run).
"""

from verispec.distill.config import DistillConfig
from verispec.distill.model import is_distilled_draft, load_draft
from verispec.distill.pipeline import DistillResult, distill

__all__ = ["DistillConfig", "DistillResult", "distill", "is_distilled_draft", "load_draft"]
