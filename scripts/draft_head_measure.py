"""Coverage and greedy agreement of trimmed, re-quantised draft heads on a prompt set.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/draft_head_measure.py \
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --prompts ../shared/data/spec_bench/question.jsonl code

1. The target answers each prompt greedily (speculative greedy output is the target's own).
2. Coverage: the share of the target's tokens inside the head of each size
   (`verispec.drafters.vocab_rank.head_ids` over the shipped ranking, special tokens kept).
3. Agreement: over the target's text, how often the draft's argmax (over the head's tokens)
   is the target's next token: the per-token acceptance of greedy verification, for each head
   size and each draft weight type.
Measurement only: the ranking itself comes from scripts/vocab_ranking.py on other prompts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from verispec import SamplingParams, SpeculativeDecoder, loading
from verispec.bench.prompt_sets import load_jsonl, prompts_path
from verispec.drafters.vocab_rank import head_ids, load_ranking, special_ids
from verispec.quant.quantized_model import GGUFModel
from verispec.quant.requant import parse_type, requantized
from verispec.runtime import make_runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", nargs="+", default=["code"])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="4096,8192,16384,32768,65536")
    parser.add_argument("--quants", default="none,q4_0",
                        help="draft weight types: none, q4_0, ..., or q4_0-layers (the head "
                             "kept as the file has it)")
    parser.add_argument("--out", help="a JSON file for the figures")
    parser.add_argument("--sequences", help="a JSON file keeping the target's answers: read "
                                            "where it exists, else written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sizes = [int(s) for s in args.sizes.split(",")]

    # 1. The target's own text on every prompt (or as an earlier run kept it).
    decoder = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft)
    tokenizer, width = decoder.tokenizer, decoder.target.vocab_size
    sequences = []  # (set name, prompt ids, output ids)
    if args.sequences and os.path.exists(args.sequences):
        with open(args.sequences) as file:
            sequences = [tuple(row) for row in json.load(file)]
    for name in args.prompts if not sequences else ():
        prompts = load_jsonl(prompts_path(name), args.per_category, seed=0)
        outputs = decoder.generate([p.text for p in prompts],
                                   SamplingParams(max_new_tokens=args.max_new_tokens))
        for prompt, output in zip(prompts, outputs, strict=True):
            sequences.append((name, decoder.encode(prompt.text, True).tolist(), output.token_ids))
        logging.info("%s: %d prompts answered", name, len(prompts))
    if args.sequences and not os.path.exists(args.sequences):
        with open(args.sequences, "w") as file:
            json.dump(sequences, file)

    # 2. Coverage of each head size.
    ranking = load_ranking(tokenizer)
    specials = special_ids(tokenizer, decoder.eos_ids)
    heads = {size: head_ids(ranking, width, size, specials) for size in sizes}
    report: dict = {"coverage": {}, "agreement": {}}
    for name in args.prompts:
        tokens = torch.tensor([t for n, _, out in sequences if n == name for t in out])
        report["coverage"][name] = {"tokens": int(tokens.numel())}
        for size, ids in heads.items():
            inside = torch.isin(tokens, ids).double().mean().item()
            report["coverage"][name][size] = round(inside, 4)

    # 3. Greedy agreement of the draft, full head and each size, per weight type.
    for quant in args.quants.split(","):
        model, _ = loading.load(args.draft, dtype="auto", dequantize=None)
        qtype = parse_type(quant.removesuffix("-layers"))
        if qtype is not None:  # "q4_0-layers": the head keeps the file's type
            model = GGUFModel(requantized(model.file, qtype, head=not quant.endswith("-layers")))
        runner = make_runner(model)
        hits = {name: {"full": 0, **dict.fromkeys(sizes, 0), "n": 0} for name in args.prompts}
        for name, prompt, output in sequences:
            ids = torch.tensor(prompt + output)
            runner.reset()
            logits = runner.logits(ids[:-1], len(output))[:, :width]  # [n, V]
            truth = torch.tensor(output)
            hits[name]["n"] += len(output)
            hits[name]["full"] += int((logits.argmax(-1) == truth).sum())
            for size, head in heads.items():
                picked = head[logits[:, head].argmax(-1)]
                hits[name][size] += int((picked == truth).sum())
        report["agreement"][quant] = {
            name: {key: round(value / counts["n"], 4) for key, value in counts.items()
                   if key != "n"} for name, counts in hits.items()}
        logging.info("agreement with draft weights %s: %s", quant, report["agreement"][quant])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
