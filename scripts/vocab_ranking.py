"""Rank a vocabulary by the tokens a target writes, for trimmed draft heads.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/vocab_ranking.py \
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct

The target answers verispec's own prompts (`verispec.distill.training_prompts`, never benchmark
questions) and the code requests below, greedily. Each token is scored by how often the target
wrote it plus the probability the target gave it at every position of its answers (one pass of
the target over each answer): the probabilities rank the many tokens it came close to writing,
which counts alone leave unranked. The ranking goes to verispec/data/vocab/<vocabulary
key>.npz (`verispec.drafters.vocab_rank`), rewritten after every batch so a shorter run still
leaves one. The draft only speeds the generation up: greedy speculative output is the target's
own.
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import sys
import time
from pathlib import Path

import torch

from verispec import SamplingParams, SpeculativeDecoder
from verispec.distill.training_prompts import builtin_prompts
from verispec.drafters.vocab_rank import ranking_path, save_ranking

# Code requests across languages (the targets this ships for write code first).
CODE_REQUESTS = (
    "Write a SQL query that lists the five customers with the most orders last month.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    "Write a C function that reverses a string in place.",
    "Write a Rust function that parses a comma-separated line into a vector of integers.",
    "Write a Go HTTP handler that returns the current time as JSON.",
    "Write a TypeScript interface for a blog post and a function that sorts posts by date.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python script that reads a CSV file and prints the average of one column.",
    "Write an HTML page with a form that asks for a name and an email address.",
    "Write CSS that centres a box horizontally and vertically on the page.",
    "Write a Java method that checks whether a string is a palindrome.",
    "Write a Python decorator that measures how long a function takes.",
    "Write a regular expression that matches dates like 2024-03-15 and explain it.",
    "Write a Dockerfile for a small Flask application.",
    "Write a Python function that validates an IPv4 address string.",
    "Write a C++ class for a fixed-size ring buffer.",
    "Write a JavaScript function that debounces another function.",
    "Write unit tests with pytest for a function that adds two numbers.",
    "Write a Python generator that yields the lines of a file that contain a given word.",
    "Write a Makefile with build, test and clean targets for a C project.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python function that computes the Levenshtein distance between two strings.",
    "Write a YAML GitHub Actions workflow that runs the tests of a Python project.",
    "Write a Python dataclass for a point in 3D space with a method for its distance to the "
    "origin.",
)


def prompt_set(count: int, seed: int) -> list[str]:
    """The code requests and `count` of verispec's built-in prompts drawn with `seed`,
    shuffled together."""
    rng = random.Random(seed)
    prompts = list(CODE_REQUESTS) + rng.sample(builtin_prompts(), count)
    rng.shuffle(prompts)
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", default="none", help="a draft that speeds generation up")
    parser.add_argument("--prompts", type=int, default=96, help="built-in prompts drawn")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the .npz to write (default: the package's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    decoder = SpeculativeDecoder.from_pretrained(target=args.target, draft=args.draft, k="auto")
    out = args.out or ranking_path(decoder.tokenizer)
    prompts = prompt_set(args.prompts, args.seed)
    counts: collections.Counter[int] = collections.Counter()
    mass = torch.zeros(decoder.target.vocab_size, dtype=torch.float64)  # [V]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    start = time.monotonic()
    for first in range(0, len(prompts), args.batch):
        # 1. One batch of prompts, answered greedily by the target.
        batch = prompts[first:first + args.batch]
        outputs = decoder.generate(batch, params)
        for prompt, output in zip(batch, outputs, strict=True):
            counts.update(output.token_ids)
            # 2. The target's probabilities at each position of its answer.
            ids = torch.cat([decoder.encode(prompt, True), torch.tensor(output.token_ids)])
            logits = decoder.target.logits(ids[:-1], len(output.token_ids))  # [n, V]
            mass += torch.softmax(logits.float(), -1).sum(0).double()
        # 3. The ranking so far, written each batch.
        done = min(first + args.batch, len(prompts))
        save_ranking(out, dict(counts), {"target": str(args.target), "prompts": done,
                                         "tokens": sum(counts.values()),
                                         "max_new_tokens": args.max_new_tokens,
                                         "seed": args.seed}, mass)
        logging.info("%d/%d prompts, %d tokens, %d distinct, %.0f s", done, len(prompts),
                     sum(counts.values()), len(counts), time.monotonic() - start)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
