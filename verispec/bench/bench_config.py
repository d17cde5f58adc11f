"""What a benchmark run measures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from verispec.bench.prompt_sets import prompts_path
from verispec.config import EngineConfig, parse_k
from verispec.params import VERIFY_METHODS

# "predicted": plain decoding with each prompt's prediction as its draft (Predicted Outputs;
# prompt sets with predictions, e.g. --prompts edits); "hybrid-predicted": the default hybrid
# drafter with the prediction, as a server runs a request that brings one; "suffix": lookup
# over the prompt and the earlier prompts' texts (a process's requests share them:
# verispec.drafters.suffix)
VERISPEC_METHODS = ("baseline", "draft", "ngram", "hybrid", "predicted", "hybrid-predicted",
                    "suffix")
HF_METHODS = ("hf-baseline", "hf-assisted", "hf-ngram")
LLAMA_CPP_METHODS = ("llama.cpp", "llama.cpp-draft")  # llama.cpp's binaries (bench/llamacpp.py)
ALL_METHODS = VERISPEC_METHODS + HF_METHODS + LLAMA_CPP_METHODS
DEFAULT_METHODS = ("baseline", "ngram", "draft", "hf-baseline", "hf-ngram", "hf-assisted")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    prompts: Path | None = None  # Spec-Bench-style JSONL; None: the built-in prompt set
    per_category: int = 2
    limit: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    methods: tuple[str, ...] = DEFAULT_METHODS
    ks: tuple[int | str, ...] = ("auto",)  # several: every speculative verispec method runs each
    # How sampled drafts are verified; several: every speculative verispec method runs each
    verifies: tuple[str, ...] = ("block",)
    # the models, runtime and draft head verispec's methods run (`engine.k` unused: `ks`);
    # `engine.draft` is also hf-assisted's assistant; the hf-* methods always run the full
    # draft head on dense weights
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    ignore_eos: bool = True  # fixed-length outputs: every method generates max_new_tokens
    hf_ngram_tokens: int = 10  # prompt_lookup_num_tokens, transformers' documented example
    out: Path = Path("bench_out")
    batch_sizes: tuple[int, ...] = ()  # set: the batched throughput benchmark at these sizes
    # Prompts per engine run, as a multiple of the batch size: 1 = static batches (a batch
    # runs until its slowest row ends); Q > 1 = continuous batching over Q*B queued prompts
    # (rows that end are replaced from the queue, as in the server).
    batch_queue: int = 4
    llama_cpp: str | None = None  # a folder holding llama-server (or DIR/bin); None: PATH

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
        if not self.methods:
            raise ValueError("no methods to run")
        repeated = sorted({m for m in self.methods if self.methods.count(m) > 1})
        if repeated:
            raise ValueError(f"methods listed more than once: {', '.join(repeated)}")
        object.__setattr__(self, "ks", tuple(parse_k(k) for k in self.ks))
        bad = [v for v in self.verifies if v not in VERIFY_METHODS]
        if bad or not self.verifies:
            raise ValueError(f"verify must be among {', '.join(VERIFY_METHODS)}, got {bad or '()'}")
        if not self.ks:
            raise ValueError("no K to run")
        if self.per_category < 1 or (self.limit is not None and self.limit < 1):
            raise ValueError("per_category and limit must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.hf_ngram_tokens, int) or self.hf_ngram_tokens < 1:
            raise ValueError(f"hf_ngram_tokens must be an integer >= 1, got "
                             f"{self.hf_ngram_tokens!r}")
        if any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers >= 1, got {self.batch_sizes}")
        if not isinstance(self.batch_queue, int) or self.batch_queue < 1:
            raise ValueError(f"batch_queue must be an integer >= 1, got {self.batch_queue}")
        if self.batch_sizes and "baseline" not in self.methods:
            raise ValueError("the batched benchmark needs the baseline method")
        if self.prompts is not None:
            object.__setattr__(self, "prompts", prompts_path(self.prompts))
        if self.prompts is not None and not Path(self.prompts).is_file():
            raise ValueError(f"prompts file not found: {self.prompts}")
        object.__setattr__(self, "out", Path(self.out))
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"out must be a folder; {self.out} is a file")
