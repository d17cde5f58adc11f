"""Training the draft to match the target's next-token distributions.

The loss at each response position is KL(p || q): p is the target's stored top-k distribution
restricted to the head's tokens and renormalised, q the draft's softmax over its head. A position
whose top-k holds no head token carries no loss. Held-out top-1 agreement (the draft's argmax is
the target's) predicts greedy acceptance, and is logged at every checkpoint.

Batches are a function of (seed, step) alone and checkpoints hold the model, optimizer, schedule
and step, so a resumed run continues as the uninterrupted one would have.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from verispec.distill.data import Transcript

log = logging.getLogger("verispec.distill")
LOG_EVERY = 20  # steps between log lines
EVAL_BATCH = 16


@dataclass(frozen=True, slots=True)
class Example:
    """One sequence prepared for the loss."""

    ids: torch.Tensor  # [T] long, cut to seq_len
    start: int  # positions start - 1 .. T - 2 predict the response tokens
    head_index: torch.Tensor  # [N, k] long: each top-k token's row in the head (0 if absent)
    probs: torch.Tensor  # [N, k] float32: target probabilities over head tokens, renormalised
    top1: torch.Tensor  # [N] long: the target's most likely token


@dataclass(frozen=True, slots=True)
class TrainSettings:
    steps: int
    batch_size: int
    lr: float
    seed: int
    checkpoint_every: int
    device: torch.device


@dataclass(slots=True)
class TrainReport:
    step: int = 0
    losses: list[float] = field(default_factory=list)  # per step run in this call
    heldout_kl: float = math.nan
    heldout_agreement: float = math.nan  # top-1 agreement with the target on held-out data


def head_vocabulary(sequences: list[Transcript], size: int, vocab_size: int,
                    always: list[int]) -> torch.Tensor:
    """The head's token ids [Vh] (sorted): `always` (special tokens), then the tokens carrying the
    most target probability in the data's top-k rows, `size` in all (fewer if fewer have any).

    Example: two rows, top-2 {3: 0.9, 5: 0.1} and {3: 0.6, 4: 0.4}, size 2, always [] -> [3, 4].
    """
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in sequences:
        mass.index_add_(0, seq.topk_ids.flatten(), seq.topk_logprobs.exp().flatten().double())
    mass[always] = math.inf
    chosen = torch.topk(mass, min(size + len(always), vocab_size)).indices
    return chosen[mass[chosen] > 0][: max(size, len(always))].sort().values


def prepare(sequences: list[Transcript], head_token_ids: torch.Tensor, vocab_size: int,
            seq_len: int) -> list[Example]:
    """Cut sequences to seq_len and map their top-k onto the head's rows."""
    row_of = torch.full((vocab_size,), -1, dtype=torch.long)  # token id -> head row, -1 if none
    row_of[head_token_ids] = torch.arange(head_token_ids.numel())
    examples = []
    for seq in sequences:
        if seq.start >= seq_len:
            continue
        ids = seq.ids[:seq_len]
        n = int(ids.numel()) - seq.start
        rows = row_of[seq.topk_ids[:n]]  # [N, k]
        probs = seq.topk_logprobs[:n].exp() * (rows >= 0)
        mass = probs.sum(-1, keepdim=True)
        probs = torch.where(mass > 0, probs / mass.clamp_min(1e-30), 0.0)
        examples.append(Example(ids, seq.start, rows.clamp_min(0), probs, seq.topk_ids[:n, 0]))
    return examples


def kl_and_agreement(draft: LlamaForCausalLM, batch: list[Example], head_token_ids: torch.Tensor
                     ) -> tuple[torch.Tensor, int, int]:
    """Mean KL over the batch's scored positions -> (kl, positions scored, top-1 agreements)."""
    device = head_token_ids.device
    width = max(int(e.ids.numel()) for e in batch)
    # Right padding needs no mask: causal attention never lets a real position see the padding.
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
    for b, e in enumerate(batch):
        ids[b, : e.ids.numel()] = e.ids
    rows = torch.cat([torch.full((int(e.ids.numel()) - e.start,), b) for b, e in enumerate(batch)])
    cols = torch.cat([torch.arange(e.start - 1, int(e.ids.numel()) - 1) for e in batch])  # [N]
    rows, cols = rows.to(device), cols.to(device)
    hidden = draft.model(input_ids=ids.to(device)).last_hidden_state  # [B, T, H]
    logq = torch.log_softmax(draft.lm_head(hidden[rows, cols]).float(), dim=-1)  # [N, Vh]
    head_index = torch.cat([e.head_index for e in batch]).to(device)  # [N, k]
    probs = torch.cat([e.probs for e in batch]).to(device)  # [N, k]
    log_ratio = torch.where(probs > 0, probs.clamp_min(1e-30).log() - logq.gather(1, head_index),
                            0.0)
    kl = (probs * log_ratio).sum(-1)  # [N]
    scored = probs.sum(-1) > 0
    agree = head_token_ids[logq.argmax(-1)] == torch.cat([e.top1 for e in batch]).to(device)
    count = int(scored.sum())
    return kl[scored].sum() / max(count, 1), count, int(agree.sum())


@torch.no_grad()
def evaluate(draft: LlamaForCausalLM, examples: list[Example], head_token_ids: torch.Tensor
             ) -> tuple[float, float]:
    """Held-out (mean KL, top-1 agreement over all response positions)."""
    kl_sum = scored = agreed = positions = 0.0
    for i in range(0, len(examples), EVAL_BATCH):
        batch = examples[i : i + EVAL_BATCH]
        kl, count, agree = kl_and_agreement(draft, batch, head_token_ids)
        kl_sum += float(kl) * count
        scored += count
        agreed += agree
        positions += sum(int(e.top1.numel()) for e in batch)
    return kl_sum / max(scored, 1), agreed / max(positions, 1)


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of step's batch: consecutive slices of one seeded permutation per epoch.

    Example: n 4, batch 3: step 0 takes 3 of epoch 0's permutation, step 1 its last one and
    the first 2 of epoch 1's.
    """
    picks = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(position, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picks.append(int(order[i]))
    return picks


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% (at most 100 steps), then cosine down to 10%."""
    warmup = max(1, min(100, steps // 20))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train(draft: LlamaForCausalLM, examples: list[Example], heldout: list[Example],
          head_token_ids: torch.Tensor, settings: TrainSettings, checkpoint: Path,
          on_checkpoint: Callable[[TrainReport], None]) -> TrainReport:
    """Train from `checkpoint` when it exists (resume), else from scratch, to settings.steps;
    every checkpoint_every steps and at the end: evaluate, save `checkpoint`, on_checkpoint."""
    if not examples:
        raise ValueError("no training data: every sequence is longer than seq_len or empty")
    head_token_ids = head_token_ids.to(settings.device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, settings.steps))
    report = TrainReport()
    if checkpoint.is_file():
        report.step = _load_checkpoint(checkpoint, draft, optimizer, schedule)
        log.info("train: resumed from %s at step %d", checkpoint, report.step)
    draft.train()
    autocast = torch.autocast(settings.device.type, dtype=torch.bfloat16,
                              enabled=settings.device.type == "cuda")
    bar = tqdm(total=settings.steps, initial=report.step, desc="train", unit="step",
               disable=None)
    window_loss, window_tokens, window_began = 0.0, 0, time.perf_counter()
    while report.step < settings.steps:
        # 1. This step's batch: a function of (seed, step) only.
        picks = batch_indices(len(examples), settings.batch_size, settings.seed, report.step)
        batch = [examples[i] for i in picks]
        # 2. KL to the target's top-k, backward, clipped step, schedule.
        with autocast:
            loss, _, _ = kl_and_agreement(draft, batch, head_token_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        report.step += 1
        report.losses.append(loss.item())
        # 3. Progress: bar, and a log line every LOG_EVERY steps with loss and tokens/s.
        window_loss += report.losses[-1]
        window_tokens += sum(int(e.ids.numel()) for e in batch)
        bar.update(1)
        if report.step % LOG_EVERY == 0 or report.step == settings.steps:
            seconds = time.perf_counter() - window_began
            steps_in_window = (report.step - 1) % LOG_EVERY + 1
            tokens_per_s = window_tokens / max(seconds, 1e-9)
            bar.set_postfix(loss=f"{window_loss / steps_in_window:.3f}",
                            tok_s=f"{tokens_per_s:.0f}")
            log.info("train: step %d/%d loss %.4f lr %.2e %.0f tokens/s", report.step,
                     settings.steps, window_loss / steps_in_window, schedule.get_last_lr()[0],
                     tokens_per_s)
            window_loss, window_tokens, window_began = 0.0, 0, time.perf_counter()
        # 4. Checkpoint: evaluate on held-out data, save, hand the draft to the caller.
        if report.step % settings.checkpoint_every == 0 or report.step == settings.steps:
            draft.eval()
            report.heldout_kl, report.heldout_agreement = evaluate(draft, heldout, head_token_ids)
            draft.train()
            log.info("train: step %d held-out KL %.4f, top-1 agreement %.3f", report.step,
                     report.heldout_kl, report.heldout_agreement)
            _save_checkpoint(checkpoint, draft, optimizer, schedule, report.step, head_token_ids)
            on_checkpoint(report)
    bar.close()
    draft.eval()
    return report


def _save_checkpoint(path: Path, draft, optimizer, schedule, step: int,
                     head_token_ids: torch.Tensor) -> None:
    state = {"model": {k: v for k, v in draft.state_dict().items()
                       if k != "model.embed_tokens.weight"},
             "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "head_token_ids": head_token_ids.cpu(),
             "rng": torch.get_rng_state()}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, draft, optimizer, schedule) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    draft.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def checkpoint_head(path: Path) -> torch.Tensor | None:
    """The head token ids a checkpoint was trained with, or None when there is no checkpoint."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)["head_token_ids"]
