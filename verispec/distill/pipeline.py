"""`verispec distill`: data written by the target, a small draft trained on it, saved to load.

    distill(DistillConfig(out=Path("runs/smol"), target=None))

1. Prompts: the built-in list (verispec's own, never benchmark questions) and prompts the target
   writes itself (questions about topics; summaries of paragraphs it wrote), in data/prompts.json.
2. Data: responses sampled from the target with its chat template (temperature 1, a quarter of
   the batches greedy) and its top-k log-probabilities, in resumable shards under data/.
3. Head vocabulary: the tokens carrying the most target probability in the training shards.
4. Training: KL to the target's top-k, checkpoints in ckpt.pt, held-out top-1 agreement logged.
5. The draft folder, draft/, rewritten at every checkpoint: `--draft RUN/draft` uses it.
Everything is logged to RUN/train.log; `resume=True` continues an interrupted run.

Sizing, SmolLM2-135M-Instruct on 2 CPU cores (measured):
- data: verispec's engine on the native runtime (bfloat16) samples ~145 tokens/s at batch
  16 and ~175 at batch 32 on short contexts (96 new tokens); a whole shard of 128 prompts with
  up to 256 new tokens, its scoring pass (~700 tokens/s) and the batch's draining tail included,
  came to 107-115 response tokens/s, ~3.5 min a shard (70-75 while another job shared the
  machine). (transformers' generate in float32 did ~60 at batch 16.)
- training a feature draft: see train-feature.log (tokens/s per step); a layers draft, batch
  8 x 320 tokens: ~1.7 s a step.
The defaults (640 prompts, 800 steps) are a run of about 1.5-2 h. A feature draft's model card
gives the command it was made with (`command_line`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec import loading
from verispec.distill.data import ShardPlan, Teacher, generate_texts, load_shard, write_shards
from verispec.distill.distill_config import DistillConfig
from verispec.distill.feature_head import (
    FEATURE_UNROLL,
    FeatureHead,
    FeatureTrainSettings,
    FrozenHead,
    target_features,
    train_feature_head,
)
from verispec.distill.lm_draft import draft_config, init_draft
from verispec.distill.train import (
    TrainReport,
    TrainSettings,
    checkpoint_head,
    head_vocabulary,
    prepare,
    train,
)
from verispec.distill.training_prompts import (
    builtin_prompts,
    passage_requests,
    question_requests,
    summary_prompt,
)
from verispec.drafters.folder import save_draft, save_feature_draft
from verispec.runtime.native.llama import NativeLlama

log = logging.getLogger("verispec.distill")
SELF_QUESTION_TOKENS = 64
SELF_PASSAGE_TOKENS = 160


@dataclass(frozen=True, slots=True)
class DistillResult:
    draft: Path  # the draft folder, for --draft
    report: TrainReport


def distill(config: DistillConfig) -> DistillResult:
    """Run (or, with config.resume, continue) the whole pipeline; return the draft folder."""
    out = config.out
    _check_run_folder(config)
    extra = extra_shards(config)
    model, tokenizer = _load_target(config)  # and what depends on it, before any write
    _prepare_run_folder(config)
    handler = logging.FileHandler(out / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return _run(config, model, tokenizer, extra)
    finally:
        log.removeHandler(handler)
        handler.close()


def _load_target(config: DistillConfig):
    """The target and its tokenizer, with the settings that depend on it checked."""
    model, tokenizer = loading.load(config.target, device=str(config.torch_device))
    if tokenizer is None:
        raise ValueError("distillation needs the target's tokenizer; this target has none")
    config.check_target(int(model.get_input_embeddings().weight.shape[0]),
                        model.config.num_hidden_layers)
    if config.kind == "layers":
        draft_config(model, config.layers)  # a Llama-family target
    return model, tokenizer


def _run(config: DistillConfig, model, tokenizer, extra: list[Path]) -> DistillResult:
    """extra: the training shards of config.extra_data's runs (`extra_shards`)."""
    out, data = config.out, config.out / "data"
    log.info("distill: %s on %s", config, config.torch_device)
    if extra:
        log.info("distill: %d extra training shards from %d earlier runs", len(extra),
                 len(config.extra_data))
    teacher = Teacher(model, tokenizer, config.chat)
    # 1-2. Prompts, then the data shards (the first, held-out shard holds the eval prompts).
    prompts = build_prompts(teacher, config, data / "prompts.json")
    plans = shard_plans(prompts, config, data)
    if config.train_shards is not None:
        plans = plans[: 1 + config.train_shards]
    write_shards(teacher, plans, config.max_new_tokens, config.batch_size, config.temperature,
                 config.greedy_fraction, config.topk, data / "progress.json")
    heldout = load_shard(plans[0].path)
    sequences = [seq for plan in plans[1:] for seq in load_shard(plan.path)]
    sequences += [seq for path in extra for seq in load_shard(path)]
    # 3. The head vocabulary: the checkpoint's when resuming, else from the training data.
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    checkpoint = out / "ckpt.pt"
    head = checkpoint_head(checkpoint)
    if head is None:
        special = sorted(set(tokenizer.all_special_ids) | set(teacher.eos_ids))
        head = head_vocabulary(sequences, config.head_vocab, vocab_size, special)
    log.info("distill: head of %d tokens, %d training sequences (%d response tokens)",
             head.numel(), len(sequences), sum(s.response_length for s in sequences))
    if config.kind == "feature":
        return _run_feature(config, model, tokenizer, sequences, heldout, head)
    # 4. Train; every checkpoint rewrites the draft folder.
    draft = init_draft(model, config.layers, head)
    draft.lm_head.weight.requires_grad_(config.train_head)
    settings = TrainSettings(config.steps, config.train_batch_size, config.lr, config.seed,
                             config.checkpoint_every, config.torch_device)
    folder = out / "draft"

    def save(report: TrainReport) -> None:
        save_draft(draft, head, folder, model, tokenizer, model_card(config, report, head.numel()),
                   config.train_head)

    report = train(draft, prepare(sequences, head, vocab_size, config.seq_len),
                   prepare(heldout, head, vocab_size, config.seq_len), head, settings,
                   checkpoint, save)
    log.info("distill: draft in %s (step %d, held-out top-1 agreement %.3f)", folder,
             report.step, report.heldout_agreement)
    return DistillResult(folder, report)


def _run_feature(config: DistillConfig, model, tokenizer, sequences, heldout, head
                 ) -> DistillResult:
    """Steps 4-5 for a feature draft: the target's features from the native runtime in the
    dtype it decodes in, then the head trained on them."""
    dtype = torch.bfloat16 if config.torch_device.type == "cpu" else torch.float32
    native = NativeLlama.from_hf(model, dtype)
    started = time.perf_counter()
    examples = target_features(native, sequences, config.seq_len, config.feature_taps)
    held = target_features(native, heldout, config.seq_len, config.feature_taps)
    log.info("distill: target features for %d + %d sequences in %.0f s", len(examples),
             len(held), time.perf_counter() - started)
    shape = native.shape
    feature_head = FeatureHead(shape, config.feature_taps)
    feature_head.init_from(model)
    frozen = FrozenHead(model, head)
    embed = model.get_input_embeddings().weight.detach().float()
    settings = FeatureTrainSettings(steps=config.steps, batch_size=config.train_batch_size,
                                    lr=config.lr, seed=config.seed, tv_weight=config.tv_weight,
                                    eval_every=config.checkpoint_every)
    started = time.perf_counter()
    report = train_feature_head(feature_head, frozen, embed, examples, held, settings,
                                config.out / "ckpt.pt", config.out / "train-feature.log")
    train_seconds = time.perf_counter() - started
    folder = config.out / "draft"
    card = feature_model_card(config, report, head.numel(), len(examples),
                              sum(int(e.ids.numel()) for e in examples), train_seconds)
    save_feature_draft(feature_head, head, folder, model, tokenizer, card)
    log.info("distill: feature draft in %s (held-out %s)", folder, report)
    return DistillResult(folder, TrainReport(step=settings.steps,
                                             heldout_kl=report.get("kl", float("nan")),
                                             heldout_agreement=report.get("agreement", 0.0)))


def feature_model_card(config: DistillConfig, report: dict, head_size: int, sequences: int,
                       positions: int, train_seconds: float | None = None) -> str:
    target = config.target or "the embedded SmolLM2-135M-Instruct"
    figures = ", ".join(f"{name} {value:.3f}" for name, value in report.items())
    timing = "" if train_seconds is None else f" in {train_seconds / 60:.0f} min"
    tv = (f" + {config.tv_weight} x its total variation distance from the draft's (the "
          f"rejection rate of a sampled draft token)" if config.tv_weight else "")
    taps = (f" (and, at its first drafting step, the hidden states after its layers "
            f"{', '.join(map(str, config.feature_taps))})" if config.feature_taps else "")
    return (
        f"# verispec feature draft for {target}\n\n"
        f"An EAGLE-style draft: one Llama layer reading the target's last hidden state{taps} "
        f"and the next token's embedding, predicting the target's next hidden state; the target's "
        f"final norm and {head_size} rows of its head (not stored) make the logits. Distilled "
        f"on {sequences} sequences ({positions} positions) the target wrote itself "
        f"({_prompt_plan(config)}, "
        f"up to {config.max_new_tokens} new tokens, temperature {config.temperature}, "
        f"{config.greedy_fraction:.0%} greedy); prompts from verispec's built-in list and the "
        f"target's own, no benchmark questions. Trained on {FEATURE_UNROLL} drafting depths "
        f"(the second reads the head's own predicted features), loss: KL from the target's "
        f"distribution over the head's tokens{tv}, plus a smooth-L1 pull on the features."
        f"\n\n"
        f"    {command_line(config)}\n\n"
        f"- trained {config.steps} steps{timing}, batch {config.train_batch_size} sequences, "
        f"lr {config.lr}, seed {config.seed}\n"
        f"- held-out (response positions): {figures}\n\n"
        f"It needs the native runtime (it reads the target's hidden states):\n\n"
        f"    verispec generate \"...\" --target TARGET --draft {config.out / 'draft'}\n"
    )


def _prompt_plan(config: DistillConfig) -> str:
    plan = f"a plan of {config.num_prompts} prompts, {config.self_prompts} of them written by " \
           f"the target"
    if config.train_shards is None:
        return plan
    return f"the first {config.train_shards} shards of {config.shard_prompts} prompts of {plan}"


def command_line(config: DistillConfig) -> str:
    """The `verispec distill` command that makes this run (flags that differ from the
    defaults)."""
    flags = {"num_prompts": "--prompts"}
    defaults = DistillConfig(out=config.out)
    parts = ["verispec distill", f"--out {config.out}"]
    for name in DistillConfig.__dataclass_fields__:
        value = getattr(config, name)
        if name in ("out", "resume") or value == getattr(defaults, name):
            continue
        flag = flags.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):  # a switch: --train-head, --no-chat
            parts.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, tuple):  # several values: --extra-data A B
            parts.append(" ".join([flag, *map(str, value)]))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _check_run_folder(config: DistillConfig) -> None:
    """A fresh run needs an empty folder; a resumed one must keep the data settings. Writes
    nothing."""
    out, manifest_path = config.out, config.out / "data" / "manifest.json"
    manifest = config.data_manifest()
    if not config.resume and out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: pass --resume to continue that run, or choose "
                         "another --out")
    if config.resume and not manifest_path.is_file():
        raise ValueError(f"nothing to resume in {out}: no run was started there (leave out "
                         "--resume to start one)")
    if manifest_path.is_file():
        saved = json.loads(manifest_path.read_text())
        changed = sorted(k for k in manifest if saved.get(k) != manifest[k])
        if changed:
            raise ValueError(f"cannot resume {out}: its data was made with other settings "
                             f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)})")


def _prepare_run_folder(config: DistillConfig) -> None:
    """The run folder with its data manifest (`_check_run_folder` first)."""
    manifest_path = config.out / "data" / "manifest.json"
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(config.data_manifest(), indent=1) + "\n")


def extra_shards(config: DistillConfig) -> list[Path]:
    """The training shards of the runs in config.extra_data, checked to hold the same kind of
    data as this run's (target, chat template, top-k)."""
    shards = []
    mine = config.data_manifest()
    for run in config.extra_data:
        manifest_path = run / "data" / "manifest.json"
        if not manifest_path.is_file():
            raise ValueError(f"--extra-data {run}: no data/manifest.json there (not a run folder)")
        theirs = json.loads(manifest_path.read_text())
        changed = [k for k in ("target", "chat", "topk") if theirs.get(k) != mine[k]]
        if changed:
            raise ValueError(f"--extra-data {run}: its data was made with other settings "
                             f"({', '.join(f'{k}={theirs.get(k)!r}' for k in changed)})")
        found = sorted((run / "data").glob("shard-*.safetensors"))
        if not found:
            raise ValueError(f"--extra-data {run}: no training shards written there yet")
        shards += found
    return shards


def build_prompts(teacher: Teacher, config: DistillConfig, path: Path) -> list[str]:
    """num_prompts + eval_prompts prompts, shuffled: self-written ones and built-in ones (cycled
    when more are needed than there are). Written once to `path`, read back when resuming."""
    if path.is_file():
        return json.loads(path.read_text())["prompts"]
    written = self_prompts(teacher, config, path.parent)
    rng = random.Random(derived_seed(config.seed, "prompts"))
    builtin = builtin_prompts()
    rng.shuffle(builtin)
    need = config.num_prompts + config.eval_prompts - len(written)
    prompts = [builtin[i % len(builtin)] for i in range(need)] + written
    rng.shuffle(prompts)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"prompts": prompts}, indent=1) + "\n")
    tmp.replace(path)
    log.info("distill: %d prompts (%d written by the target)", len(prompts), len(written))
    return prompts


def self_prompts(teacher: Teacher, config: DistillConfig, data: Path) -> list[str]:
    """Prompts the target writes: half requests of many kinds about many subjects, half
    summarise/extract/answer requests over paragraphs it wrote. Empty replies are dropped.
    The replies so far are kept in data/self-questions.json and data/self-passages.json: a
    resumed run continues them."""
    seed = derived_seed(config.seed, "self-prompts")
    questions = config.self_prompts // 2
    asked = generate_texts(teacher, question_requests(questions, seed),
                           min(SELF_QUESTION_TOKENS, config.max_new_tokens), config.batch_size,
                           config.temperature, seed, data / "self-questions.json",
                           "self-prompts: questions")
    passages = generate_texts(teacher, passage_requests(config.self_prompts - questions, seed),
                              min(SELF_PASSAGE_TOKENS, config.max_new_tokens), config.batch_size,
                              config.temperature, seed + 1, data / "self-passages.json",
                              "self-prompts: passages")
    return [q for q in asked if q] + [summary_prompt(i, p) for i, p in enumerate(passages) if p]


def shard_plans(prompts: list[str], config: DistillConfig, data: Path) -> list[ShardPlan]:
    """The held-out shard (the first eval_prompts prompts), then training shards of
    shard_prompts prompts each, every one with its own seed. A prompt that came earlier in the
    plan (the built-in list is cycled when more prompts are asked for) is marked a repeat, so
    it is never decoded greedily twice."""
    seen: set[str] = set()
    repeats = []
    for prompt in prompts:
        repeats.append(prompt in seen)
        seen.add(prompt)
    held = config.eval_prompts
    plans = [ShardPlan(data / "heldout.safetensors", tuple(prompts[:held]),
                       derived_seed(config.seed, "heldout"), tuple(repeats[:held]))]
    for i, first in enumerate(range(held, len(prompts), config.shard_prompts)):
        last = first + config.shard_prompts
        plans.append(ShardPlan(data / f"shard-{i:05d}.safetensors", tuple(prompts[first:last]),
                               derived_seed(config.seed, f"shard-{i}"), tuple(repeats[first:last])))
    return plans


def derived_seed(seed: int, salt: str) -> int:
    """A seed for one part of the run, decorrelated from the others."""
    return int(hashlib.sha256(f"{seed}:{salt}".encode()).hexdigest()[:8], 16)


def model_card(config: DistillConfig, report: TrainReport, head_size: int) -> str:
    target = config.target or "the embedded SmolLM2-135M-Instruct"
    return (
        f"# verispec draft for {target}\n\n"
        f"A {config.layers}-layer Llama draft distilled by `verispec distill` from responses the "
        f"target sampled itself ({config.num_prompts} prompts, up to {config.max_new_tokens} "
        f"tokens each, temperature {config.temperature}, {config.greedy_fraction:.0%} greedy) "
        f"on KL to the target's top-{config.topk} distributions. Prompts: verispec's built-in "
        f"list and prompts the target wrote; no benchmark questions.\n\n"
        f"- embedding: the target's, frozen, taken from the target at load time (not stored)\n"
        f"- LM head: {head_size} most frequent tokens, "
        f"{'trained' if config.train_head else 'the target rows, frozen (not stored)'}\n"
        f"- trained {report.step} steps, batch {config.train_batch_size}, lr {config.lr}, seed "
        f"{config.seed}\n"
        f"- held-out top-1 agreement with the target: {report.heldout_agreement:.3f} "
        f"(KL {report.heldout_kl:.3f})\n\n"
        f"Use it with its target only:\n\n"
        f"    verispec generate \"...\" --target TARGET --draft {config.out / 'draft'}\n"
    )
