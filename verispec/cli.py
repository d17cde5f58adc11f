"""`verispec` command line: generate (more subcommands come with the benchmark and server)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from verispec.errors import VerispecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the user message (chat template applied unless --no-chat)")
    add_model_args(gen)
    gen.add_argument("--k", default="5",
                     help="draft tokens per round: a number (default 5), 'auto' (chosen each "
                          "round from measured costs) or 'heuristic' (+2/-1 schedule)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, stats} on stdout")
    gen.set_defaults(run=run_generate)
    return parser


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", default="default",
                        help="draft model folder/.gguf, 'ngram', 'none' (plain decoding) or "
                             "'default' (the best drafter shipped for the target)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")


def run_generate(args: argparse.Namespace) -> int:
    from verispec import SamplingParams, SpeculativeDecoder

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
        stop=tuple(args.stop))
    decoder = SpeculativeDecoder.from_pretrained(
        target=args.target, draft=args.draft, k=args.k, dtype=args.dtype, device=args.device,
        chat=not args.no_chat)
    if args.json:
        output = decoder.generate(args.prompt, params)
        json.dump({"text": output.text, "token_ids": output.token_ids,
                   "finish_reason": output.finish_reason, "stats": output.stats.to_dict()},
                  sys.stdout)
        sys.stdout.write("\n")
        return 0
    output = None
    for chunk in decoder.stream(args.prompt, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        output = chunk.output
    sys.stdout.write("\n")
    print(format_stats(output.stats, output.finish_reason), file=sys.stderr)
    return 0


def format_stats(stats, finish_reason: str) -> str:
    return (
        f"[{stats.new_tokens} tokens in {stats.wall_s:.2f}s = {stats.tokens_per_s:.1f} tok/s | "
        f"k={stats.k} acceptance {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.checked}) | "
        f"{stats.tokens_per_forward:.2f} tokens/forward over {stats.target_forwards} forwards "
        f"(formula {stats.expected_tokens:.2f}) | finish: {finish_reason}]"
    )


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="verispec: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (VerispecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
