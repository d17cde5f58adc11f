"""What a benchmark run measures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verispec.bench.prompt_sets import prompts_path
from verispec.config import DEFAULT_TREE_WIDTH, check_tree_width
from verispec.drafters.load import DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB
from verispec.params import VERIFY_METHODS
from verispec.policy import parse_k

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
    target: str | None = None
    draft: str | None = "default"  # for `draft`, `hf-assisted`: a path, or the shipped one
    dtype: str = "auto"  # verispec's runners (see make_runner); hf-* run float32 under auto
    runtime: str = "auto"  # auto | hf | native, for verispec's methods
    int8: bool = False  # weight-only int8 (native runtime), verispec's methods
    # how a quantized GGUF target (and draft) run: "auto" (loading.weights_for), None (their own
    # bit width) or "bf16" (dequantised by transformers, as the hf-* methods always need)
    dequantize: str | None = "auto"
    # a draft model's trimmed head (None: full) and re-quantised weights (None: the file's),
    # as from_pretrained takes them; the hf-* methods always run the full draft
    draft_vocab: int | None = DEFAULT_DRAFT_VOCAB
    draft_quant: str | None = DEFAULT_DRAFT_QUANT
    seed: int = 0
    ignore_eos: bool = True  # fixed-length outputs: every method generates max_new_tokens
    hf_ngram_tokens: int = 10  # prompt_lookup_num_tokens, transformers' documented example
    out: Path = Path("bench_out")
    batch_sizes: tuple[int, ...] = ()  # set: the batched throughput benchmark at these sizes
    # Prompts per scheduler run, as a multiple of the batch size: 1 = static batches (a batch
    # runs until its slowest row ends); Q > 1 = continuous batching over Q*B queued prompts
    # (rows that end are replaced from the queue, as in the server).
    batch_queue: int = 4
    tree_width: int = DEFAULT_TREE_WIDTH  # a feature draft's greedy rows: trees this wide
    sampled_tree_width: int = 1  # its sampled rows
    llama_cpp: str | None = None  # a folder holding llama-server (or DIR/bin); None: PATH

    def __post_init__(self) -> None:
        check_tree_width(self.tree_width)
        check_tree_width(self.sampled_tree_width)
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
        if not self.methods:
            raise ValueError("no methods to run")
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
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
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
