"""Distillation data: responses sampled from the target, with its top-k log-probabilities.

A shard is one safetensors file of S sequences (prompt + response) and, for every response
token, the target's top-k next-token log-probabilities at the position that predicts it:

    ids [total] int32            the sequences, concatenated
    offsets [S + 1] int64        sequence i is ids[offsets[i] : offsets[i + 1]]
    starts [S] int64             where sequence i's response starts (its prompt length)
    topk_ids [N, k] int32        N = the summed response lengths; each row sorted, best first
    topk_logprobs [N, k] float16
    features [total, H] bfloat16 the target's last hidden state (before its final norm) at every
                                 position, from the same pass; only when the target ran on the
                                 native runtime (feature drafts train on them)

Example: prompt [5, 6], response [7, 8] -> ids [5, 6, 7, 8], start 2, and two top-k rows, read
from the positions that predict 7 (position 1) and 8 (position 2).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from verispec.decoder import SpeculativeDecoder
from verispec.params import SamplingParams
from verispec.runtime.native.native_runner import NativeRunner

log = logging.getLogger("verispec.distill")


@dataclass(frozen=True, slots=True)
class Transcript:
    """One training example the target wrote: a prompt, its response, the target's top-k
    log-probabilities at every response position (and its features, for feature drafts)."""

    ids: torch.Tensor  # [T] long: prompt + response
    start: int  # the response is ids[start:]
    topk_ids: torch.Tensor  # [T - start, k] long: row r predicts ids[start + r]
    topk_logprobs: torch.Tensor  # [T - start, k] float32
    features: torch.Tensor | None = None  # [T, H]: the target's features (native runtime only)

    @property
    def response_length(self) -> int:
        return int(self.ids.numel()) - self.start


class Teacher:
    """The target as a data source: encodes prompts, samples responses in continuous batches on
    verispec's own runtime (native where the architecture allows), scores them."""

    def __init__(self, model: PreTrainedModel, tokenizer, chat: bool) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.decoder = SpeculativeDecoder(model, tokenizer, drafter=None, chat=False)
        self.runner = self.decoder.target.sibling()  # the scoring pass's own cache
        self.eos_ids = tuple(sorted(self.decoder.eos_ids))
        self.max_positions = self.decoder.target.max_positions

    def encode(self, text: str) -> list[int]:
        """A user message -> prompt ids (chat template with the assistant turn opened, or plain
        text when the tokenizer has no template)."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def sample(self, prompts: list[list[int]], max_new_tokens: int,
               temperatures: list[float | None], seeds: list[int], max_batch: int
               ) -> list[list[int]]:
        """Responses to `prompts`, row i sampled at temperatures[i] (None: greedy) with
        seeds[i], decoded `max_batch` rows at a time with continuous batching (a finished row's
        slot is refilled at once); each response ends with its EOS, if it met one. A row's
        tokens do not depend on which rows share its batch (native runtime)."""
        engine = self.decoder.engine(max_batch=max_batch)
        rows = {}
        for i, (prompt, temperature, seed) in enumerate(
                zip(prompts, temperatures, seeds, strict=True)):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature or 0.0,
                                    seed=seed)
            rows[engine.add_request(prompt, params, chat=False)] = i
        outputs = engine.run()
        return [list(outputs[request].token_ids) for request in sorted(rows, key=rows.get)]

    @torch.inference_mode()
    def score(self, ids: list[int], start: int, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Teacher-forced pass over one sequence -> the top-k (ids [N, k] long, log-probs [N, k]
        float32) at the N = len(ids) - start positions that predict the response tokens, and
        the target's features [len(ids), H] when it runs natively (else None)."""
        n = len(ids) - start
        if isinstance(self.runner, NativeRunner):  # one pass, features kept
            cache = self.runner.cache
            logits = self.runner.model.forward(torch.tensor(ids), 0, n + 1, cache)  # [N + 1, V]
            features = cache.features[: len(ids)].clone()
        else:
            self.runner.reset()
            logits = self.runner.logits(torch.tensor(ids), num_logits=n + 1)
            features = None
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [N, V]
        top = torch.topk(logprobs, k, dim=-1)
        return top.indices.cpu(), top.values.cpu(), None if features is None else features.cpu()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


def generate_texts(teacher: Teacher, requests: list[str], max_new_tokens: int, batch_size: int,
                   temperature: float, seed: int, checkpoint: Path | None = None,
                   desc: str = "replies") -> list[str]:
    """The target's decoded replies to `requests` (used to write self-prompts), reply i sampled
    with seed + i. With a checkpoint file the replies so far are saved every few batches and a
    rerun continues from them: a reply does not depend on which rows shared its batch, so a
    resumed run writes what an uninterrupted one would. A checkpoint written for other requests
    (another verispec's prompt lists) is refused rather than continued."""
    saved = json.loads(checkpoint.read_text()) \
        if checkpoint is not None and checkpoint.is_file() else {"replies": []}
    replies = saved["replies"]
    if "requests" in saved and saved["requests"] != requests[:len(replies)]:
        raise ValueError(f"{checkpoint} holds replies to other requests than this run asks "
                         "(written by another verispec version?): finish that run with the "
                         "version that started it, or start a new run folder")
    chunk = 4 * batch_size
    bar = tqdm(total=len(requests), initial=len(replies), desc=desc, unit="reply", disable=None)
    for first in range(len(replies), len(requests), chunk):
        texts = requests[first:first + chunk]
        responses = teacher.sample([teacher.encode(text) for text in texts], max_new_tokens,
                                   [temperature] * len(texts),
                                   [seed + first + i for i in range(len(texts))], batch_size)
        replies += [teacher.decode(r) for r in responses]
        if checkpoint is not None:
            _write_atomic(checkpoint, json.dumps({"replies": replies,
                                                  "requests": requests[:len(replies)]}).encode())
        bar.update(len(texts))
    bar.close()
    return replies


@dataclass(frozen=True, slots=True)
class ShardPlan:
    path: Path
    prompts: tuple[str, ...]
    seed: int
    # repeats[i]: prompts[i] came earlier in the run's plan; a repeat is always sampled (a
    # greedy response to it would copy one the run may already hold)
    repeats: tuple[bool, ...]


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
    bar = tqdm(total=len(todo), desc="data", unit="shard", disable=None)
    for plan in todo:
        # 1. Sample the shard's prompts in one continuous batch (greedy rows drawn by seed),
        #    then score every sequence in a teacher-forced pass.
        began = time.perf_counter()
        prompts, temperatures, seeds = _rows(teacher, plan, greedy_fraction, temperature,
                                             max_new_tokens)
        responses = teacher.sample(prompts, max_new_tokens, temperatures, seeds, batch_size)
        sequences = []
        for prompt, response in zip(prompts, responses, strict=True):
            top_ids, top_logprobs, features = teacher.score(prompt + response, len(prompt),
                                                            topk)
            sequences.append(Transcript(torch.tensor(prompt + response), len(prompt), top_ids,
                                      top_logprobs, features))
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
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / max(seconds, 1e-9):.1f}")
    bar.close()


def _rows(teacher: Teacher, plan: ShardPlan, greedy_fraction: float, temperature: float,
          max_new_tokens: int) -> tuple[list[list[int]], list[float | None], list[int]]:
    """The shard's prompts encoded (those with room for a response), each row's temperature
    (None, greedy, with probability greedy_fraction, unless the prompt is a repeat) and seed,
    all drawn from the plan's seed."""
    encoded = [teacher.encode(text) for text in plan.prompts]
    rows = [(p, repeat) for p, repeat in zip(encoded, plan.repeats, strict=True)
            if len(p) + max_new_tokens <= teacher.max_positions]
    if len(rows) < len(encoded):
        log.warning("data: %d prompts skipped: no room for the response in the context",
                    len(encoded) - len(rows))
    rng = random.Random(plan.seed)
    temperatures = [None if rng.random() < greedy_fraction and not repeat else temperature
                    for _, repeat in rows]
    return [p for p, _ in rows], temperatures, [plan.seed + i for i in range(len(rows))]


def save_shard(path: Path, sequences: list[Transcript]) -> None:
    lengths = torch.tensor([0] + [int(s.ids.numel()) for s in sequences])
    tensors = {
        "ids": torch.cat([s.ids for s in sequences]).to(torch.int32),
        "offsets": torch.cumsum(lengths, 0),
        "starts": torch.tensor([s.start for s in sequences], dtype=torch.int64),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]).to(torch.int32),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in sequences]).to(torch.float16),
    }
    if sequences and all(s.features is not None for s in sequences):
        tensors["features"] = torch.cat([s.features for s in sequences]).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(tmp))
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Transcript]:
    t = safetensors.torch.load_file(str(path))
    offsets, starts = t["offsets"].tolist(), t["starts"].tolist()
    sequences, row = [], 0
    for i, start in enumerate(starts):
        ids = t["ids"][offsets[i] : offsets[i + 1]].long()
        n = len(ids) - start
        features = t["features"][offsets[i] : offsets[i + 1]] if "features" in t else None
        sequences.append(Transcript(ids, start, t["topk_ids"][row : row + n].long(),
                                  t["topk_logprobs"][row : row + n].float(), features))
        row += n
    return sequences


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
