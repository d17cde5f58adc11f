"""The methods a benchmark compares, all on the same loaded model objects.

verispec methods run through `SpeculativeDecoder`; hf-* methods call transformers'
`generate` itself (plain, `assistant_model=`, `prompt_lookup_num_tokens=`), and llama.cpp-*
methods run llama.cpp's own binaries (`verispec.bench.llamacpp`), so the comparison is with the
peers' real code.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from verispec.decoder import SpeculativeDecoder
from verispec.drafters import SuffixDrafter
from verispec.params import SamplingParams


@dataclass(frozen=True, slots=True)
class MethodRun:
    token_ids: list[int]
    wall_s: float
    target_forwards: int
    accepted: int | None = None  # None where the method does not report acceptance
    checked: int | None = None
    per_position_accepted: tuple[int, ...] = ()
    per_position_checked: tuple[int, ...] = ()
    expected_tokens: float | None = None
    mean_k: float | None = None
    decode_tokens_per_s: float | None = None  # a peer's own decode-only rate (llama.cpp's)
    accepted_prediction: int | None = None  # Predicted Outputs' counts, where a prediction ran
    rejected_prediction: int | None = None
    ttft_s: float | None = None  # verispec's: its first token's time (the prompt's pass)
    sources: dict | None = None  # verispec's: GenerationStats.sources


class VerispecMethod:
    runtime = "verispec"

    def __init__(self, name: str, decoder: SpeculativeDecoder, verify: str | None = None,
                 takes_prediction: bool = False, group: str | None = None) -> None:
        """verify: the verification procedure its sampled rows use (None: the params');
        takes_prediction: the runner hands it each prompt's prediction (Predicted Outputs);
        group: the methods whose decoders share one cost model (`share_costs`: a method's
        verify modes at one K), by default its name."""
        self.name = name
        self.decoder = decoder
        self.verify = verify
        self.takes_prediction = takes_prediction
        self.group = group or name

    def params(self, params: SamplingParams) -> SamplingParams:
        """The params it runs a request with: the given ones under its verify mode."""
        return params if self.verify is None else dataclasses.replace(params, verify=self.verify)

    def forget_text(self) -> None:
        """Empty its suffix lookup's cache of earlier requests: text a warm-up or an earlier
        run of the same prompts wrote is never proposed to a timed run."""
        drafter = self.decoder.drafter
        for lookup in (drafter, getattr(drafter, "lookup", None)):  # a hybrid's lookup
            if isinstance(lookup, SuffixDrafter):
                lookup.cache.clear()

    def run(self, prompt_ids: list[int], params: SamplingParams,
            prediction: str | None = None) -> MethodRun:
        self.decoder.reset()  # every method pays its own prompt pass
        out = self.decoder.generate(prompt_ids, self.params(params), prediction=prediction)
        stats = out.stats
        return MethodRun(out.token_ids, stats.wall_s, stats.target_forwards, stats.accepted,
                         stats.checked, tuple(stats.per_position_accepted),
                         tuple(stats.per_position_checked), stats.expected_tokens, stats.mean_k,
                         accepted_prediction=stats.accepted_prediction_tokens
                         if prediction is not None else None,
                         rejected_prediction=stats.rejected_prediction_tokens
                         if prediction is not None else None,
                         ttft_s=stats.ttft_s, sources=stats.sources)


class HFMethod:
    """transformers' generate with extra arguments; counts the target's forward calls."""

    runtime = "hf"

    def __init__(self, name: str, model: PreTrainedModel, eos_ids: frozenset[int],
                 **generate_kwargs) -> None:
        self.name = name
        self.model = model
        self.eos_ids = eos_ids
        self.generate_kwargs = generate_kwargs
        self._calls = 0

    def _count(self, module, args, output) -> None:
        self._calls += 1

    def run(self, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
        config = generation_config(params, self.eos_ids)
        input_ids = torch.tensor([prompt_ids], device=self.model.device)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        self._calls = 0
        # The hook counts target forwards during this run only: the model is shared with the
        # other methods, whose timing it must not touch.
        hook = self.model.register_forward_hook(self._count)
        try:
            with _defaults_without_eos(self.model, self.generate_kwargs, params.ignore_eos):
                start = time.perf_counter()
                with torch.inference_mode():
                    output = self.model.generate(input_ids,
                                                 attention_mask=torch.ones_like(input_ids),
                                                 generation_config=config,
                                                 **self.generate_kwargs)
                wall_s = time.perf_counter() - start
        finally:
            hook.remove()
        return MethodRun(output[0, len(prompt_ids):].tolist(), wall_s, self._calls)


@contextmanager
def _defaults_without_eos(model, generate_kwargs: dict, ignore_eos: bool):
    """generate() fills an unset eos_token_id from the model's own generation config, so a
    fixed-length run has to clear it there (and on the assistant), then restore it."""
    models = [model, generate_kwargs.get("assistant_model")]
    configs = [m.generation_config for m in models if m is not None] if ignore_eos else []
    saved = [c.eos_token_id for c in configs]
    for c in configs:
        c.eos_token_id = None
    try:
        yield
    finally:
        for c, eos in zip(configs, saved, strict=True):
            c.eos_token_id = eos


def generation_config(params: SamplingParams, eos_ids: frozenset[int]) -> GenerationConfig:
    """The transformers equivalent of SamplingParams (EOS ignored by passing none)."""
    eos = sorted(eos_ids)
    sampling = {} if params.greedy else dict(
        temperature=params.temperature, top_k=params.top_k or None,
        top_p=params.top_p if params.top_p < 1 else None, min_p=params.min_p or None)
    return GenerationConfig(
        max_new_tokens=params.max_new_tokens, min_new_tokens=None, do_sample=not params.greedy,
        eos_token_id=None if params.ignore_eos else eos, pad_token_id=eos[0] if eos else 0,
        **sampling)
