"""Run every method on every prompt, interleaved, and write the results."""

from __future__ import annotations

import logging
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
import transformers
from tqdm import tqdm

from verispec import loading
from verispec.bench import llamacpp
from verispec.bench.bench_config import BenchConfig
from verispec.bench.interleave import rotated
from verispec.bench.methods import HFMethod, MethodRun, VerispecMethod
from verispec.bench.prompt_sets import builtin_prompts, load_jsonl
from verispec.bench.report import REFERENCE, summarise, write_outputs
from verispec.bench.throughput import run_batch_bench, write_batch_outputs
from verispec.decoder import SpeculativeDecoder
from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter, SuffixDrafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.folder import is_feature_draft, load_draft
from verispec.drafters.load import load_draft_model, load_drafter
from verispec.params import SamplingParams
from verispec.runtime import Runner, make_runner
from verispec.vocab import vocab_size

log = logging.getLogger("verispec")


def run_bench(config: BenchConfig, progress: bool = True) -> dict:
    """Measure, write results.json / report.md / plots into config.out, return the results."""
    # 0. What can be refused is refused before any model loads: the output folder, and every
    #    line of the prompt file.
    try:
        config.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=config.out):  # an existing folder may be read-only
            pass
    except OSError as err:
        raise ValueError(f"cannot write the results to {config.out}: {err.strerror}") from None
    prompts = (load_jsonl(config.prompts, config.per_category, config.seed, config.limit)
               if config.prompts else builtin_prompts(config.per_category, config.limit))
    # 1. Models, loaded once and shared by every method.
    engine = config.engine
    dense = engine.runtime == "hf" or engine.int8 or any(m.startswith("hf-")
                                                         for m in config.methods)
    dequantize = "bf16" if dense else engine.dequantize
    model, tokenizer = loading.load(engine.target, dtype=engine.dtype, dequantize=dequantize)
    draft_model, assistant_model, head_token_ids, feature_drafter = None, None, None, None
    draft = engine.draft
    if draft == "default":
        draft = loading.default_draft(engine.target)
    if draft is not None and is_feature_draft(draft):
        # reads the target's features as it runs: no separate runner, no transformers peer
        feature_drafter = load_drafter(draft, model, tokenizer, tree_width=engine.tree_width,
                                       sampled_tree_width=engine.sampled_tree_width,
                                       dequantize=dequantize)
    elif draft is not None:
        trim = {} if dense else {"draft_vocab": engine.draft_vocab,
                                 "draft_quant": engine.draft_quant}
        loaded = load_draft_model(draft, model, tokenizer, dtype=engine.dtype,
                                  dequantize=dequantize, **trim)
        draft_model, head_token_ids, assistant_model = (loaded.model, loaded.head_token_ids,
                                                        loaded.model)
        if head_token_ids is not None and dense:
            # verispec drafts with the subset head it was trained with; transformers needs
            # full-width logits, so its assistant is the same layers with the target's full head.
            assistant_model, _ = load_draft(draft, model, tokenizer, full_head=True)
    # verispec's methods share one runner per model (each run resets its cache); hf-* methods
    # run the transformers model as loaded.
    draft_runner = None
    if draft_model is not None:
        draft_runner = make_runner(draft_model, engine.runtime, engine.dtype, engine.int8)
    runners = Runners(make_runner(model, engine.runtime, engine.dtype, engine.int8),
                      draft_runner, feature_drafter)
    encoder = SpeculativeDecoder(model, tokenizer, None, runtime=runners.target)
    methods, notes = build_methods(config, model, tokenizer, runners, assistant_model,
                                   head_token_ids, encoder.eos_ids)

    # 2. Prompts, encoded once with the chat template.
    prompt_ids = [encoder.encode(p.text, chat=True).tolist() for p in prompts]
    predicting = [m.name for m in methods if getattr(m, "takes_prediction", False)]
    if predicting and all(p.prediction is None for p in prompts):
        notes.append(f"{', '.join(predicting)}: these prompts bring no prediction, so "
                     f"{'it runs' if len(predicting) == 1 else 'they run'} without one")

    if config.batch_sizes:
        return _run_batched(config, methods, notes, prompt_ids, model, runners)

    # 3. Warm-up (and the cost model of every adaptive method: one per group, measured by
    #    its first method and shared by the others), then the interleaved runs.
    costs: dict[str, dict] = {}
    for method in methods:
        method.run(prompt_ids[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
        if isinstance(method, VerispecMethod):
            method.forget_text()  # the warm-up's text is not proposed to the runs
        decoder = getattr(method, "decoder", None)
        if decoder is not None and decoder.k == "auto":
            entry = costs.setdefault(method.group, dict(asdict(decoder.costs), methods=[]))
            entry["methods"].append(method.name)
    records = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run",
               disable=not progress, file=sys.stderr)
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
        params = SamplingParams(max_new_tokens=config.max_new_tokens,
                                temperature=config.temperature, seed=config.seed + i,
                                ignore_eos=config.ignore_eos)
        runs: dict[str, MethodRun] = {}
        for method in rotated(methods, i):  # machine noise hits every method alike
            bar.set_postfix_str(f"{prompt.category}: {method.name}")
            runs[method.name] = (method.run(ids, params, prompt.prediction)
                                 if getattr(method, "takes_prediction", False)
                                 else method.run(ids, params))
            bar.update()
        records.extend(prompt_records(prompt, len(ids), methods, runs, params.greedy))
    bar.close()

    results = summarise(records, methods, config.ks)
    decoders = [m.decoder for m in methods if getattr(m, "decoder", None) is not None]
    if decoders:  # the decode loop's knobs every verispec method ran with
        results["decode_config"] = decoders[0].config.as_dict()
    results.update(config=config_dict(config), machine=machine_info(config, model, runners),
                   costs=costs, notes=notes)
    write_outputs(results, config.out)
    return results


def _run_batched(config: BenchConfig, methods, notes, prompt_ids, model, runners) -> dict:
    """Batched throughput of verispec's methods (transformers' have no batched assisted path)."""
    skipped = [m.name for m in methods if m.runtime != "verispec"]
    if skipped:
        notes.append(f"{', '.join(skipped)} skipped: the batched benchmark compares verispec's "
                     "methods with verispec's plain batched decoding")
    # plain batched decoding first: every other method is measured against it
    mine = sorted((m for m in methods if m.runtime == "verispec"),
                  key=lambda m: m.name != "baseline")
    if not mine or mine[0].name != "baseline":
        raise ValueError("the batched benchmark needs the baseline method")
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                            seed=config.seed, ignore_eos=config.ignore_eos)
    results = dict(batch=run_batch_bench(mine, prompt_ids, config.batch_sizes, params,
                                         queue=config.batch_queue),
                   config=config_dict(config), machine=machine_info(config, model, runners),
                   notes=notes, prompts_count=len(prompt_ids))
    write_batch_outputs(results, config.out)
    return results


@dataclass(frozen=True, slots=True)
class Runners:
    target: Runner
    draft: Runner | None
    feature_drafter: FeatureDrafter | None = None  # a draft that reads the target's features


def build_methods(config: BenchConfig, model, tokenizer, runners: Runners, assistant_model,
                  head_token_ids, eos_ids: frozenset[int]):
    methods, notes = [], []
    # decoders of one target and draft model (or of lookups) are priced by one measurement:
    # the first one's (`CostTable.share_measurements`)
    measured: dict[str, SpeculativeDecoder] = {}

    def priced_alike(decoder: SpeculativeDecoder, kind: str) -> None:
        if kind in measured:
            decoder.cost_table.share_measurements(measured[kind].cost_table)
        else:
            measured[kind] = decoder

    for name in config.methods:
        if name == "hf-assisted" and runners.feature_drafter is not None:
            notes.append("hf-assisted skipped: the draft reads the target's features, which "
                         "transformers' assisted generation cannot give it")
            continue
        if name in ("draft", "hybrid", "hybrid-predicted", "hf-assisted") and \
                runners.draft is None and \
                runners.feature_drafter is None:
            notes.append(f"{name} skipped: no draft model given (--draft PATH), and none is "
                         "shipped for this target")
            continue
        if name == "baseline":  # (invariant sampling draws its own way: a baseline of its own)
            for verify in ["block"] + [v for v in config.verifies if v == "invariant"]:
                methods.append(VerispecMethod(
                    name if verify == "block" else f"{name}[invariant]",
                    SpeculativeDecoder(model, tokenizer, None, runtime=runners.target,
                                       config=config.engine.decode), verify))
        elif name in ("ngram", "suffix", "draft", "hybrid"):
            for k in config.ks:
                group = name if len(config.ks) == 1 else f"{name}[k={k}]"
                first = None
                for verify in config.verifies:
                    decoder = SpeculativeDecoder(
                        model, tokenizer, _drafter(name, model, runners, head_token_ids), k=k,
                        runtime=runners.target, config=config.engine.decode)
                    # One cost model for the verify modes of one (method, K): measured once,
                    # so that they take the same K decisions and differ only in verification.
                    if first is None:
                        first = decoder
                        priced_alike(decoder, "lookup" if name in ("ngram", "suffix")
                                     else "model")
                    else:
                        decoder.share_costs(first)
                    label = group if len(config.verifies) == 1 else f"{group}[{verify}]"
                    methods.append(VerispecMethod(label, decoder, verify, group=group))
        elif name in ("predicted", "hybrid-predicted"):
            drafter = None if name == "predicted" else _drafter("hybrid", model, runners,
                                                                  head_token_ids)
            decoder = SpeculativeDecoder(model, tokenizer, drafter, k=config.ks[0],
                                         runtime=runners.target, config=config.engine.decode)
            if drafter is not None:
                priced_alike(decoder, "model")
            methods.append(VerispecMethod(name, decoder, takes_prediction=True))
        elif name == "hf-baseline":
            methods.append(HFMethod(name, model, eos_ids))
        elif name == "hf-ngram":
            methods.append(HFMethod(name, model, eos_ids,
                                    prompt_lookup_num_tokens=config.hf_ngram_tokens))
        elif name == "hf-assisted":
            methods.append(HFMethod(name, model, eos_ids, assistant_model=assistant_model))
    llamacpp.add_methods(config, methods, notes)
    return methods, notes


def _drafter(name: str, model, runners: Runners, head_token_ids):
    """A fresh drafter for one decoder of method `name` ("ngram", "suffix", "draft" or
    "hybrid"). A suffix drafter's cache starts empty and fills with the prompts it runs."""
    if name == "ngram":
        return NgramDrafter()
    if name == "suffix":
        return SuffixDrafter()
    if runners.feature_drafter is not None:
        drafter = runners.feature_drafter.fork()
    else:
        drafter = ModelDrafter(runners.draft, vocab_size(model), head_token_ids)
    return HybridDrafter(drafter) if name == "hybrid" else drafter


def prompt_records(prompt, prompt_tokens: int, methods, runs: dict[str, MethodRun],
                   greedy: bool) -> list[dict]:
    records = []
    for method in methods:
        run = runs[method.name]
        reference = REFERENCE[method.runtime]
        equal = None
        if greedy and reference in runs and method.name != reference:
            equal = run.token_ids == runs[reference].token_ids
        records.append(dict(
            question_id=prompt.question_id, category=prompt.category, method=method.name,
            runtime=method.runtime, prompt_tokens=prompt_tokens, new_tokens=len(run.token_ids),
            equal_to_baseline=equal, **{k: v for k, v in asdict(run).items() if k != "token_ids"}))
    return records


def config_dict(config: BenchConfig) -> dict:
    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in asdict(config).items()}


def machine_info(config: BenchConfig, model, runners: Runners) -> dict:
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, dtype=config.engine.dtype,
                runtime=runners.target.describe(), hf_dtype=str(model.dtype).removeprefix("torch."),
                device=str(runners.target.device))
