"""Distillation data: responses sampled from the target, with its top-k log-probabilities.

A shard is one safetensors file of S sequences (prompt + response) and, for every response
token, the target's top-k next-token log-probabilities at the position that predicts it:

    ids [total] int32            the sequences, concatenated
    offsets [S + 1] int64        sequence i is ids[offsets[i] : offsets[i + 1]]
    starts [S] int64             where sequence i's response starts (its prompt length)
    topk_ids [N, k] int32        N = the summed response lengths; each row sorted, best first
    topk_logprobs [N, k] float16

Example: prompt [5, 6], response [7, 8] -> ids [5, 6, 7, 8], start 2, and two top-k rows, read
from the positions that predict 7 (position 1) and 8 (position 2).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedModel

from verispec.decoder import _eos_ids

log = logging.getLogger("verispec.distill")


@dataclass(frozen=True, slots=True)
class Sequence:
    ids: torch.Tensor  # [T] long: prompt + response
    start: int  # the response is ids[start:]
    topk_ids: torch.Tensor  # [T - start, k] long: row r predicts ids[start + r]
    topk_logprobs: torch.Tensor  # [T - start, k] float32

    @property
    def response_length(self) -> int:
        return int(self.ids.numel()) - self.start


class Teacher:
    """The target as a data source: encodes prompts, samples responses in batches, scores them."""

    def __init__(self, model: PreTrainedModel, tokenizer, chat: bool) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.device = next(model.parameters()).device
        eos = sorted(_eos_ids(model, tokenizer))
        self.eos_ids = tuple(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))

    def encode(self, text: str) -> list[int]:
        """A user message -> prompt ids (chat template with the assistant turn opened, or plain
        text when the tokenizer has no template)."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float | None,
               seed: int) -> list[list[int]]:
        """One batch: responses for `prompts` (left-padded), sampled at `temperature` or greedy
        when it is None; each cut after its first EOS."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # [B, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        sampling = {"do_sample": False} if temperature is None else {
            "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(self.eos_ids),
                                  pad_token_id=self.pad_id, **sampling)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device),
                                      attention_mask=mask.to(self.device),
                                      generation_config=config)
        return [self._cut_at_eos(row) for row in out[:, width:].tolist()]

    @torch.inference_mode()
    def score(self, ids: list[int], start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass over one sequence -> the top-k (ids [N, k] long, log-probs [N, k]
        float32) at the N = len(ids) - start positions that predict the response tokens."""
        n = len(ids) - start
        out = self.model(input_ids=torch.tensor([ids], device=self.device), logits_to_keep=n + 1)
        logprobs = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)  # [N, V]
        top = torch.topk(logprobs, k, dim=-1)
        return top.indices.cpu(), top.values.cpu()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _cut_at_eos(self, row: list[int]) -> list[int]:
        for i, token in enumerate(row):
            if token in self.eos_ids:
                return row[: i + 1]
        return row


def generate_texts(teacher: Teacher, requests: list[str], max_new_tokens: int, batch_size: int,
                   temperature: float, seed: int) -> list[str]:
    """The target's decoded replies to `requests` (used to write self-prompts)."""
    replies = []
    for i in range(0, len(requests), batch_size):
        prompts = [teacher.encode(text) for text in requests[i : i + batch_size]]
        responses = teacher.sample(prompts, max_new_tokens, temperature, seed + i)
        replies += [teacher.decode(r) for r in responses]
    return replies


@dataclass(frozen=True, slots=True)
class ShardPlan:
    path: Path
    prompts: tuple[str, ...]
    seed: int


def write_shards(teacher: Teacher, plans: list[ShardPlan], max_new_tokens: int, batch_size: int,
                 temperature: float, greedy_fraction: float, topk: int, progress: Path) -> None:
    """Write every planned shard that does not exist yet (a resumed run skips finished ones);
    record tokens and tokens/s in `progress` (JSON)."""
    todo = [plan for plan in plans if not plan.path.is_file()]
    if len(todo) < len(plans):
        log.info("data: %d of %d shards already written, skipped", len(plans) - len(todo),
                 len(plans))
    state = json.loads(progress.read_text()) if progress.is_file() else {"tokens": 0,
                                                                           "seconds": 0.0}
    batches = sum(-(-len(plan.prompts) // batch_size) for plan in todo)
    bar = tqdm(total=batches, desc="data", unit="batch", disable=None)
    for plan in todo:
        # 1. Sample and score the shard's prompts, batch by batch (greedy batches drawn by seed).
        began = time.perf_counter()
        sequences = []
        for batch, greedy in _batches(teacher, plan, batch_size, greedy_fraction,
                                      max_new_tokens):
            responses = teacher.sample(batch, max_new_tokens, None if greedy else temperature,
                                       plan.seed + len(sequences))
            for prompt, response in zip(batch, responses, strict=True):
                top_ids, top_logprobs = teacher.score(prompt + response, len(prompt), topk)
                sequences.append(Sequence(torch.tensor(prompt + response), len(prompt), top_ids,
                                          top_logprobs))
            bar.update(1)
        # 2. Write it atomically, then the progress record.
        save_shard(plan.path, sequences)
        seconds = time.perf_counter() - began
        tokens = sum(s.response_length for s in sequences)
        state = {"tokens": state["tokens"] + tokens, "seconds": state["seconds"] + seconds}
        state["tokens_per_s"] = state["tokens"] / max(state["seconds"], 1e-9)
        state["shards_done"] = sum(p.path.is_file() for p in plans)
        state["shards_total"] = len(plans)
        _write_atomic(progress, json.dumps(state, indent=1).encode())
        log.info("data: %s (%d/%d), %d sequences, %d response tokens in %.0f s (%.1f tokens/s)",
                 plan.path.name, state["shards_done"], len(plans), len(sequences), tokens,
                 seconds, tokens / max(seconds, 1e-9))
        bar.set_postfix(tok_s=f"{tokens / max(seconds, 1e-9):.1f}")
    bar.close()


def _batches(teacher: Teacher, plan: ShardPlan, batch_size: int, greedy_fraction: float,
             max_new_tokens: int) -> Iterator[tuple[list[list[int]], bool]]:
    """The shard's prompts encoded, sorted by length (less padding), in batches, each marked
    greedy with probability greedy_fraction (seeded)."""
    encoded = [teacher.encode(text) for text in plan.prompts]
    kept = sorted((p for p in encoded if len(p) + max_new_tokens <= teacher.max_positions),
                  key=len)
    if len(kept) < len(encoded):
        log.warning("data: %d prompts skipped: no room for the response in the context",
                    len(encoded) - len(kept))
    rng = random.Random(plan.seed)
    for i in range(0, len(kept), batch_size):
        yield kept[i : i + batch_size], rng.random() < greedy_fraction


def save_shard(path: Path, sequences: list[Sequence]) -> None:
    lengths = torch.tensor([0] + [int(s.ids.numel()) for s in sequences])
    tensors = {
        "ids": torch.cat([s.ids for s in sequences]).to(torch.int32),
        "offsets": torch.cumsum(lengths, 0),
        "starts": torch.tensor([s.start for s in sequences], dtype=torch.int64),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]).to(torch.int32),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in sequences]).to(torch.float16),
    }
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(tmp))
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Sequence]:
    t = safetensors.torch.load_file(str(path))
    offsets, starts = t["offsets"].tolist(), t["starts"].tolist()
    sequences, row = [], 0
    for i, start in enumerate(starts):
        ids = t["ids"][offsets[i] : offsets[i + 1]].long()
        n = len(ids) - start
        sequences.append(Sequence(ids, start, t["topk_ids"][row : row + n].long(),
                                  t["topk_logprobs"][row : row + n].float()))
        row += n
    return sequences


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
