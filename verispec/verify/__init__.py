"""Verification of drafts against the target: pure functions over tensors.

  chains  token-wise and block verification (the PyTorch reference) and the steps every
          procedure shares; `procedure` decides which one a row runs;
  native  the same two procedures in C++ for float32 chains on the CPU;
  trees   greedy, drafter-invariant and recursive rejection sampling of one row's token tree;
  rows    `verify_rows`: a ragged batch of chains, each row by its own method, one host sync;
  drafts  `verify_drafts`: a round's drafts (chains and trees) against its target logits.

Three lossless procedures for sampled rows (one row's random draws are the same alone or in a
batch):
  token-wise  x_i is accepted with probability min(1, p(x_i) / q(x_i)) until the first
              rejection (Leviathan et al. 2023; Chen et al. 2023);
  block       decides on the whole draft at once and never accepts fewer tokens in expectation
              (Sun et al. 2025, arXiv 2403.10444);
  invariant   accepts a draft token exactly when it equals the target's own position-keyed draw
              (Daliri, Musco, Suresh 2024): the output is the very output of plain
              `invariant_sample` for that seed, whatever the drafter, K, tree or batch.
The first two are exact in distribution, for any q; the third token for token, for a seed.
Greedy rows accept while the draft equals the target's argmax.
"""

from verispec.verify.chains import PAD_TOKEN, residual
from verispec.verify.drafts import Verified, verify_drafts
from verispec.verify.rows import METHODS, RowVerification, verify_rows
from verispec.verify.trees import greedy_verify_tree, invariant_verify_tree, rejection_sample_tree

__all__ = [
    "METHODS",
    "PAD_TOKEN",
    "RowVerification",
    "Verified",
    "greedy_verify_tree",
    "invariant_verify_tree",
    "rejection_sample_tree",
    "residual",
    "verify_drafts",
    "verify_rows",
]
