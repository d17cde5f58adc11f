"""Runners: one sequence of a causal LM with its KV cache, behind one protocol.

The layers, top to bottom:
- `runner`: the `Runner` protocol (all that drafters, the engine and the scheduler may call:
  logits for a row, rollback, reset, sibling, the cached ids, the model's limits) and
  `PrefixRunner`, the bookkeeping of which tokens a cache holds, shared by every runtime.
- `hf`: `HFRunner`, any transformers causal LM with a croppable cache, through its own code.
- `native`: verispec's runtime for Llama-family models (`NativeRunner` over `NativeLlama`, with
  optional C++ kernels): batch-invariant logits, many rows in one pass, token trees, and the
  hidden states a feature draft reads.
- this module: `make_runner`, which picks the runtime for a model, and `batched_logits`, which
  runs many rows through whichever runtime they are on.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from verispec.config import RUNTIMES
from verispec.quant.quantized_model import GGUFModel
from verispec.runtime.hf import HFRunner
from verispec.runtime.native import NativeLlama, NativeRunner, UnsupportedModelError
from verispec.runtime.native import batched_logits as native_batched_logits
from verispec.runtime.native.gguf_model import gguf_runner
from verispec.runtime.runner import DTYPES, PrefixRunner, Runner, common_prefix

log = logging.getLogger("verispec")

__all__ = ["DTYPES", "RUNTIMES", "HFRunner", "NativeRunner", "PrefixRunner", "Runner",
           "batched_logits", "common_prefix", "make_runner"]



def batched_logits(runners: list[Runner], sequences: list[torch.Tensor],
                   num_logits: list[int], parents: list[torch.Tensor | None] | None = None
                   ) -> list[torch.Tensor]:
    """runner.logits(ids, n[, parents]) for many sequences: one forward pass when the runners
    are native runners of one model, one pass per sequence otherwise (transformers' runtime
    keeps each sequence in its own cache). Either way a row's logits equal what it gets alone."""
    parents = parents or [None] * len(runners)
    if runners and all(isinstance(r, NativeRunner) and r.model is runners[0].model
                       for r in runners):
        return native_batched_logits(runners, sequences, num_logits, parents)
    return [runner.logits(ids, n, p)
            for runner, ids, n, p in zip(runners, sequences, num_logits, parents, strict=True)]


def make_runner(model: PreTrainedModel, runtime: str = "auto", dtype: str = "auto",
                int8: bool = False) -> Runner:
    """The runner for `model`: "native" (verispec's Llama runtime, verispec.runtime.native),
    "hf" (transformers' modelling code) or "auto" (native for the architectures it supports,
    with a logged note when it falls back to hf).

    dtype "auto" keeps the model's dtype on hf and takes bfloat16 on the native runtime on a CPU,
    where it is both faster and batch-invariant (speculative greedy equals plain greedy);
    another dtype converts the native weights (the hf model is used as loaded). Models in other
    dtypes (float64) stay on hf under "auto".
    int8: weight-only int8 linear layers, native runtime only.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(model, GGUFModel):  # a quantized GGUF at its own bit width
        return gguf_runner(model, runtime, dtype, int8)
    if runtime == "hf":
        if int8:
            raise ValueError("int8 weights need the native runtime (--runtime native or auto)")
        return HFRunner(model)
    device, model_dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if dtype == "auto" and model_dtype not in DTYPES.values():
        if runtime == "native":
            raise ValueError(f"the native runtime runs {', '.join(DTYPES)}, not {model_dtype}")
        return HFRunner(model)
    if dtype != "auto":
        native_dtype = DTYPES[dtype]
    elif device.type == "cpu" or int8:
        native_dtype = torch.bfloat16
    else:
        native_dtype = model_dtype
    try:
        return NativeRunner(NativeLlama.from_hf(model, native_dtype, int8=int8))
    except UnsupportedModelError as err:
        if runtime == "native" or int8:
            raise
        log.info("native runtime unavailable (%s): using transformers' modelling code", err)
        return HFRunner(model)
