"""What a distillation run does: one frozen, self-validating dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.drafters.folder import taps_fit

# The fields that decide what the data is: a resumed run must keep them.
DATA_FIELDS = ("target", "num_prompts", "self_prompts", "eval_prompts", "shard_prompts",
               "max_new_tokens", "batch_size", "temperature", "greedy_fraction", "topk", "chat",
               "seed")


@dataclass(frozen=True, slots=True)
class DistillConfig:
    """Defaults: a run of about 1.5-2 h for SmolLM2-135M on 2 CPU cores (see the sizing note in
    verispec.distill.pipeline); on a GPU the same settings take minutes."""

    out: Path  # run folder: data/, ckpt.pt, train.log, and the draft in draft/
    target: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    # Data: prompts, responses sampled from the target, its top-k log-probabilities.
    num_prompts: int = 640  # training prompts (built-in and self-written), one response each
    self_prompts: int = 96  # of num_prompts, how many the target writes itself
    eval_prompts: int = 16  # extra prompts whose responses form the held-out shard
    shard_prompts: int = 64  # prompts per data shard (the unit of resumption)
    train_shards: int | None = None  # write and train on only the first N training shards of
    # the prompt plan (a shorter run over the same prompts); None: all of them
    max_new_tokens: int = 256
    batch_size: int = 16  # rows decoded together when writing data
    train_batch: int | None = None  # sequences per training step (None: batch_size)
    temperature: float = 1.0  # sampling temperature of the responses
    greedy_fraction: float = 0.25  # share of response rows decoded greedily
    topk: int = 16  # target log-probabilities kept per position
    chat: bool = True  # apply the chat template when the tokenizer has one
    extra_data: tuple[Path, ...] = ()  # run folders of earlier runs on the same target whose
    # training shards are trained on too (their held-out shards are not)
    # Draft and training.
    kind: str = "layers"  # "layers": a small LM on token embeddings; "feature": an EAGLE-style
    # head on the target's features (needs the native runtime at inference)
    layers: int = 2
    head_vocab: int = 8192  # the draft's LM head covers this many most frequent tokens
    train_head: bool = False  # False: head rows frozen to the target's (not stored)
    steps: int = 800
    lr: float = 1e-3
    feature_taps: tuple[int, ...] = ()  # feature drafts: also read the target's hidden states
    # after these many of its layers (EAGLE-3's low and mid-level features), e.g. (3, 15)
    tv_weight: float = 0.0  # feature drafts: weight of the total variation distance in the
    # loss (1 - TV is the acceptance of a sampled draft token), relative to the KL
    seq_len: int = 512  # sequences are cut to this many tokens for training
    checkpoint_every: int = 100
    seed: int = 0
    device: str = "auto"  # "auto": cuda when available, else cpu
    resume: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "extra_data", tuple(Path(p) for p in self.extra_data))
        object.__setattr__(self, "feature_taps", tuple(self.feature_taps))
        positive = ("num_prompts", "eval_prompts", "shard_prompts", "max_new_tokens",
                    "batch_size", "topk", "layers", "head_vocab", "steps", "seq_len",
                    "checkpoint_every")
        optional = ("train_shards", "train_batch")  # None: see their comments
        for name in positive + optional:
            value = getattr(self, name)
            if name in optional and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.self_prompts <= self.num_prompts:
            raise ValueError(f"self_prompts must be in [0, num_prompts={self.num_prompts}], "
                             f"got {self.self_prompts}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0 <= self.greedy_fraction <= 1:
            raise ValueError(f"greedy_fraction must be in [0, 1], got {self.greedy_fraction}")
        if not 0 <= self.tv_weight < math.inf:
            raise ValueError(f"tv_weight must be a finite number >= 0, got {self.tv_weight}")
        if not 0 < self.lr < math.inf:  # an infinite rate trains every weight to NaN
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"out must be a run folder; {self.out} is a file")
        if self.kind not in ("layers", "feature"):
            raise ValueError(f"kind must be 'layers' or 'feature', got {self.kind!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 1
               for t in self.feature_taps) or len(set(self.feature_taps)) < len(
                self.feature_taps):
            raise ValueError(f"feature_taps must be distinct layer counts >= 1, got "
                             f"{self.feature_taps!r}")
        if self.feature_taps and self.kind != "feature":
            raise ValueError("feature_taps is for kind 'feature' drafts")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda", "mps")):
            raise ValueError(f"device must be auto, cpu, cuda[:N] or mps, got {self.device!r}")

    @property
    def train_batch_size(self) -> int:
        return self.batch_size if self.train_batch is None else self.train_batch

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def check_target(self, vocab_size: int, num_layers: int) -> None:
        """The settings that depend on the target, checked once it is loaded and before anything
        is written: top-k, a layers draft's depth, the taps. (A head_vocab past the vocabulary
        is the whole vocabulary.)"""
        if self.topk > vocab_size:
            raise ValueError(f"topk must be at most the target's vocabulary ({vocab_size}), "
                             f"got {self.topk}")
        if self.kind == "layers" and self.layers > num_layers:
            raise ValueError(f"layers must be at most the target's {num_layers}, got "
                             f"{self.layers}")
        if not taps_fit(self.feature_taps, num_layers):
            raise ValueError(f"feature_taps must lie inside the target's {num_layers} layers, "
                             f"got {self.feature_taps}")

    def data_manifest(self) -> dict:
        """The fields that decide the data, as JSON-ready values."""
        values = asdict(self)
        return {name: values[name] for name in DATA_FIELDS}
