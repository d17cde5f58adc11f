"""What a decoder runs and how, in two frozen configurations.

`EngineConfig` is everything `SpeculativeDecoder.from_config` needs: the models, the runtime,
the draft's head, K, and the decode loop's knobs (`DecodeConfig`). `from_pretrained`'s
keywords, the command line's flags (`verispec.cli_args.engine_config`), the server and the
bench all build one, so a run is described in one place (the bench records it with its
results). docs/configuration.md has every field, its flag and its default in one table.

`DecodeConfig` holds every tunable number that the round planner, the K policies and the cost
model read: `EngineConfig(decode=DecodeConfig(tree_max_batch=4))`. The defaults are the values
the benchmarks chose (docs/choosing-k.md, docs/token-trees.md).

This module imports nothing from verispec: drafters, policies and the engine all read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# A token tree verified in one pass stays a short pass: the native runtime attends
# batch-invariantly over passes of up to 16 positions (the tree's nodes plus its root).
MAX_TREE_NODES = 15
DEFAULT_TREE_WIDTH = 8  # greedy rows of a feature draft propose trees this wide
# A draft model's head keeps this many of the target's most written tokens (0/None: all);
# docs/draft-head.md has the measurement behind it.
DEFAULT_DRAFT_VOCAB = 65536
# A GGUF draft's wider block matrices are re-quantised to this type at load (None: kept).
DEFAULT_DRAFT_QUANT = "q4_0"
DRAFT_QUANTS = ("q4_0", "q4_1", "q5_0", "q8_0")
RUNTIMES = ("auto", "hf", "native")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEQUANTIZE = ("auto", "bf16", None)  # None: a GGUF file's own formats


def check_tree_width(width: int) -> int:
    """A tree width as a user gives it: an integer in [1, MAX_TREE_NODES] (1: chains)."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_TREE_NODES:
        raise ValueError(f"tree width must be an integer in [1, {MAX_TREE_NODES}] (1: chains), "
                         f"got {width!r}")
    return width


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    # K under k="auto": at most this many draft tokens a round (the cost model times passes
    # over 1..auto_k_max + 1 positions).
    auto_k_max: int = 8
    # k="heuristic" (transformers' +2 / -1 schedule) starts here.
    heuristic_start_k: int = 5
    # Batch cost models are measured at these sizes; a batch is priced at the next one up.
    cost_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # A batch speculates only when its cost model predicts at least this gain: lockstep
    # drafting has bookkeeping the model does not price, so a predicted +2% loses.
    batch_margin: float = 1.10
    # Greedy rows draft token trees in batches up to this size and chains in bigger ones: a
    # tree's wide pass is nearly free for one row and dear when every row of a batch has one.
    tree_max_batch: int = 1
    # A draft step cheaper than this (relative to a target step) counts as free: n-gram
    # lookups, whose proposals are then cut by their kind rather than priced before drafting.
    cheap_draft: float = 0.01
    # Acceptance estimates: the 0.5 prior weighs this many rounds of evidence, and evidence
    # decays by estimate_decay a round. A light prior lets a weak draft's estimate fall below
    # break-even (a heavy one kept it drafting at a loss); the decay lets K = 0 drift back to
    # the prior within a few rounds, so speculation is retried.
    prior_weight: float = 0.5
    estimate_decay: float = 0.85
    # A draft model's estimate starts optimistic (lookups start at 0.5): where its step costs
    # half a target step (Qwen2.5-Coder-0.5B for the 1.5B), a 0.5 prior prices K = 1 out from
    # the first round, and with nothing drafted no evidence ever raises the estimate. A weak
    # draft's estimate falls within a round or two and is retried every ~15 rounds.
    draft_prior: float = 0.8
    # A source whose estimate prices it out (K = 0) is still tried with one token once it has
    # gone this many rounds without evidence (and at its first proposal): its acceptance is
    # then learnt, not assumed, at most one extra position every probe_every rounds. A probe
    # that finds it still priced out doubles the wait before the next one (up to 16 times
    # probe_every); a round that uses it on its merits brings the wait back to probe_every.
    probe_every: int = 16
    # A draft model that lags far behind its row (a long prompt it has not read, or tokens
    # lookups and a prediction added) catches up only where what it saves over the next
    # catch_up_horizon tokens of output at most pays for the catching up.
    catch_up_horizon: int = 512
    # A long prompt is fed in chunks, one a round, so a long prompt arriving in a running batch
    # delays the other rows' rounds by one chunk's pass, not its whole pass. That pass is the
    # longest wait between two of another stream's tokens, and its attention grows with the
    # prompt already fed, so chunks shrink as it grows: prefill_chunk tokens at the start,
    # half that once prefill_knee tokens are in (`chunk_at`), never below 16.
    prefill_chunk: int = 256
    prefill_knee: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.auto_k_max, int) or not 1 <= self.auto_k_max <= MAX_TREE_NODES:
            raise ValueError(f"auto_k_max must be an integer in [1, {MAX_TREE_NODES}], "
                             f"got {self.auto_k_max!r}")
        if self.heuristic_start_k < 1:
            raise ValueError(f"heuristic_start_k must be >= 1, got {self.heuristic_start_k}")
        sizes = self.cost_batch_sizes
        rising = all(a < b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        if not sizes or sizes[0] != 1 or not rising:
            raise ValueError(f"cost_batch_sizes must rise from 1, got {sizes!r}")
        if self.batch_margin < 1.0:
            raise ValueError(f"batch_margin must be >= 1, got {self.batch_margin}")
        if self.tree_max_batch < 0:
            raise ValueError(f"tree_max_batch must be >= 0, got {self.tree_max_batch}")
        if not 0.0 <= self.cheap_draft < 1.0:
            raise ValueError(f"cheap_draft must be in [0, 1), got {self.cheap_draft}")
        if not 0.0 < self.draft_prior < 1.0:
            raise ValueError(f"draft_prior must be in (0, 1), got {self.draft_prior}")
        if self.prior_weight <= 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.catch_up_horizon < 1:
            raise ValueError(f"catch_up_horizon must be >= 1, got {self.catch_up_horizon}")
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16, got {self.prefill_chunk}")
        if self.prefill_knee < 1:
            raise ValueError(f"prefill_knee must be >= 1, got {self.prefill_knee}")
        if not 0.0 < self.estimate_decay <= 1.0:
            raise ValueError(f"estimate_decay must be in (0, 1], got {self.estimate_decay}")

    def as_dict(self) -> dict:
        """For reports: every knob by name."""
        return asdict(self)

    def chunk_at(self, fed: int) -> int:
        """The prompt tokens a round feeds once `fed` are in: prefill_chunk / (1 + fed / knee),
        at least 16. Example: 256, knee 1024: 256 at 0, 128 at 1024, 42 at 5120."""
        return max(16, int(self.prefill_chunk / (1 + fed / self.prefill_knee)))

    def cost_batch_size(self, batch: int) -> int:
        """The measured batch size a batch of `batch` rows is priced at (the next one up)."""
        return next((b for b in self.cost_batch_sizes if b >= batch), self.cost_batch_sizes[-1])


def parse_k(k: int | str) -> int | str:
    """k as given by a user: an integer >= 0, "auto" or "heuristic"."""
    if isinstance(k, str) and k.strip().isdigit():
        k = int(k)
    if isinstance(k, str) and k in ("auto", "heuristic"):
        return k
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        return k
    raise ValueError(f"k must be an integer >= 0, 'auto' or 'heuristic', got {k!r}")


def check_device(device: object) -> None:
    """A device this torch can run on ("cpu", "cuda", "cuda:1", "mps"), else ValueError, before
    anything loads (torch's own errors come after the weights have been read)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', "
                         f"got {device!r}") from None
    if parsed.type == "cpu":
        return
    # torch.cuda, torch.xpu, ...: each accelerator's module says whether it is there
    backend = torch.backends.mps if parsed.type == "mps" else getattr(torch, parsed.type, None)
    if not callable(getattr(backend, "is_available", None)) or not backend.is_available():
        seen = "sees no CUDA GPU" if parsed.type == "cuda" else "cannot use it here"
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) {seen}")
    if parsed.type == "cuda" and parsed.index is not None \
            and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs "
                         f"here")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A decoder's configuration; validated when built (bad values raise ValueError)."""

    # a model name (`verispec models`), HF folder or .gguf file; None: the embedded SmolLM2
    target: str | None = None
    # "default" (the target's shipped draft with lookup, else lookup), "hybrid:PATH", "ngram",
    # "suffix", a draft model's name, folder or .gguf, or None (plain decoding)
    draft: str | None = "default"
    k: int | str = "auto"  # draft tokens a round: "auto", "heuristic" or a number
    runtime: str = "auto"  # "auto", "hf" (transformers) or "native"
    dtype: str = "auto"  # "auto": bfloat16 on the native CPU runtime, else the model's
    device: str = "cpu"
    int8: bool = False  # weight-only int8 layers (native runtime)
    # a quantized GGUF: "auto" (its own bit width where the kernels multiply it, else bf16
    # where the bf16 kernels run), None (its own bit width) or "bf16" (dequantised)
    dequantize: str | None = "auto"
    draft_vocab: int | None = DEFAULT_DRAFT_VOCAB  # a draft model's head (None or 0: full)
    draft_quant: str | None = DEFAULT_DRAFT_QUANT  # a GGUF draft re-quantised (None: kept)
    tree_width: int = DEFAULT_TREE_WIDTH  # greedy rows of a feature draft: trees this wide
    sampled_tree_width: int = 1  # sampled rows (1: chains)
    chat: bool = True  # text prompts go through the tokenizer's chat template
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", parse_k(self.k))
        for name in ("target", "draft"):
            if isinstance(getattr(self, name), str) and not getattr(self, name).strip():
                raise ValueError(f"{name} is empty: give a model name (`verispec models`), a "
                                 f"folder or a .gguf file" + (", or 'none'" if name == "draft"
                                                             else ""))
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, "
                             f"got {self.runtime!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.int8 and self.runtime == "hf":
            raise ValueError("int8 weights need the native runtime (--runtime native or auto)")
        if self.dequantize not in DEQUANTIZE:
            raise ValueError(f"dequantize must be 'auto', 'bf16' or None, "
                             f"got {self.dequantize!r}")
        vocab = self.draft_vocab
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                                  or vocab < 0):
            raise ValueError(f"draft_vocab must be an integer >= 0 or None, got {vocab!r}")
        if isinstance(self.draft_quant, str) and self.draft_quant.lower() == "none":
            object.__setattr__(self, "draft_quant", None)  # as the command line says it
        if self.draft_quant is not None and str(self.draft_quant).lower() not in DRAFT_QUANTS:
            raise ValueError(f"draft_quant must be one of {', '.join(DRAFT_QUANTS)} or None, "
                             f"got {self.draft_quant!r}")
        check_tree_width(self.tree_width)
        check_tree_width(self.sampled_tree_width)
        check_device(self.device)
        if not isinstance(self.decode, DecodeConfig):
            raise ValueError(f"decode must be a DecodeConfig, got {type(self.decode).__name__}")

    def as_dict(self) -> dict:
        """For reports: every field by name, the decode loop's knobs nested."""
        return asdict(self)
