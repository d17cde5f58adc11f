"""The flags several `verispec` commands share, and what they build: the model and runtime
flags, `serve`'s flags, and the server settings and decoder those name. Apart from the command
line itself (verispec.cli), so the Ray Serve deployment builds its replicas from the same
flags without importing the whole CLI."""

from __future__ import annotations

import argparse
import os
import socket

from verispec.config import DEFAULT_TREE_WIDTH, DRAFT_QUANTS


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="a model name (`verispec models`), HF checkpoint folder or .gguf "
                             "file (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", default="default",
                        help="draft model name, folder or .gguf, 'ngram', 'suffix' (lookup "
                             "over earlier requests too), 'none' (plain "
                             "decoding) or 'default' (the target's default draft with n-gram "
                             "lookup, else n-gram lookup)")
    add_runtime_args(parser)
    add_tree_arg(parser)
    parser.add_argument("--device", default="cpu")


def engine_config(args: argparse.Namespace, **fields):
    """The EngineConfig a command's model and runtime flags name (`fields` set the others:
    k, chat, decode). --draft-vocab / --draft-quant unset: the defaults; "none": None."""
    from verispec.config import DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, EngineConfig

    vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    quant = DEFAULT_DRAFT_QUANT if args.draft_quant is None else args.draft_quant
    return EngineConfig(
        target=args.target, draft=None if args.draft == "none" else args.draft,
        runtime=args.runtime, dtype=args.dtype, device=getattr(args, "device", "cpu"),
        int8=args.int8,
        dequantize=None if args.dequantize == "none" else args.dequantize,
        draft_vocab=vocab or None, draft_quant=None if quant == "none" else quant,
        tree_width=args.tree_width, sampled_tree_width=args.sampled_tree_width, **fields)


def add_tree_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree-width", type=int, default=DEFAULT_TREE_WIDTH,
                        help="greedy rows of a feature draft (the shipped one) propose token "
                             f"trees this wide, verified in one pass (default "
                             f"{DEFAULT_TREE_WIDTH}; 1: chains)")
    parser.add_argument("--sampled-tree-width", type=int, default=1,
                        help="sampled rows: that many candidates for the next token, drawn "
                             "without replacement and verified together (default 1: chains)")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime", default="auto", choices=["auto", "hf", "native"],
                        help="native: verispec's Llama-family runtime; hf: transformers; auto "
                             "(default): native where supported")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): bfloat16 on the native CPU runtime, else float32")
    parser.add_argument("--int8", action="store_true",
                        help="weight-only int8 linear layers (native runtime)")
    parser.add_argument("--dequantize", default="auto", choices=["auto", "bf16", "none"],
                        help="a quantized GGUF model: bf16 dequantises it through transformers "
                             "(bfloat16 weights), none runs its own formats; auto (default): "
                             "its own formats where the AVX2 or AVX-512 kernels multiply most "
                             "of them as panels (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K), else bf16 "
                             "where the C++ bfloat16 kernels run (AVX512-BF16, AMX), its own "
                             "formats elsewhere")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                        help="a draft model's head keeps the N tokens the target writes most "
                             "(special tokens always); 0: the full head (default: 65536 where "
                             "a ranking ships for the tokenizer)")
    parser.add_argument("--draft-quant", default=None,
                        choices=[*DRAFT_QUANTS, "none"],
                        help="a GGUF draft's wider block matrices are re-quantised to this type "
                             "once (cached in ~/.cache/verispec); none: as the file has them "
                             "(default: q4_0)")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """`verispec serve`'s flags (also what `verispec.server.ray_serve:build_app` reads)."""
    add_model_args(serve)
    serve.add_argument("--k", default="auto",
                       help="draft tokens per round: 'auto' (default), a number, or 'heuristic'")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=16,
                       help="requests decoded together (default 16)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a slot; more are answered 429 (default 64)")
    serve.add_argument("--model-name", default=None,
                       help="the `model` clients name (default: the target's folder or file "
                            "name, smollm2-135m-instruct for the embedded model)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="request bodies over this are answered 413 (default 4 MiB)")
    serve.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="prompts over this many tokens are answered 400 (default: the "
                            "model's context less one)")
    serve.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1/* (default: the "
                            "VERISPEC_API_KEY environment variable; unset: no key)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics and /health too")
    serve.add_argument("--docs", action="store_true",
                       help="serve /docs, /redoc and /openapi.json (off by default; the docs "
                            "pages load their JavaScript and CSS from a public CDN)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds the requests in flight get to finish after SIGTERM or "
                            "Ctrl-C, then they are cancelled (default 10)")
    serve.add_argument("--suffix-cache", default="per-key", choices=("per-key", "shared", "off"),
                       help="whose earlier prompts and outputs may serve a request: the "
                            "cross-request lookup proposes from them, and a prompt that starts "
                            "as one of them starts from its cached keys and values (GGUF "
                            "models): per-key (default: requests with the same API key), "
                            "shared (every request), off (none)")
    serve.add_argument("--idle-cache-mb", type=int, default=None, metavar="MB",
                       help="memory the KV caches of finished requests may keep for later "
                            "requests to start from; past it the least recently used go "
                            "(default: an eighth of the machine's memory; 0 keeps none)")
    serve.add_argument("--cache-memory-mb", type=int, default=None, metavar="MB",
                       help="memory the KV caches of all requests may take: a request waits "
                            "until its caches fit beside the running ones' (default: three "
                            "quarters of the memory available at start)")
    ray = serve.add_argument_group("several machines (Ray Serve; pip install 'verispec[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve from replicas on a Ray cluster, requests that share a prompt "
                          "prefix going to the replica that saw it (docs/server.md)")
    ray.add_argument("--replicas", type=int, default=None,
                     help="replicas, each with its own engine (default 1)")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="as many replicas as the load needs, between MIN and MAX")
    ray.add_argument("--replica-cpus", type=float, default=None, metavar="N",
                     help="cores per replica, several replicas to a machine (default: one "
                          "replica per machine, using all its cores)")
    ray.add_argument("--address", default=None,
                     help="the Ray cluster to join ('auto': the one `ray start` began on this "
                          "machine; default: RAY_ADDRESS, else a new local one)")


def serve_config(args: argparse.Namespace):
    """The ServerConfig of `verispec serve`'s flags (raises ValueError on a bad one)."""
    from verispec.server import ServerConfig
    from verispec.server.settings import DEFAULT_MAX_BODY_BYTES

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or VERISPEC_API_KEY) is empty: give a key, or leave both "
                         "unset to serve without one")
    check_listenable(args.host, args.port)
    return ServerConfig(
        max_batch=args.max_batch, max_queue=args.max_queue,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else
        args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, api_key=args.api_key,
        protect_metrics=args.protect_metrics, docs=args.docs,
        shutdown_timeout=args.shutdown_timeout, suffix_cache=args.suffix_cache,
        idle_cache_bytes=None if args.idle_cache_mb is None else args.idle_cache_mb << 20,
        cache_memory=None if args.cache_memory_mb is None else args.cache_memory_mb << 20)


def check_listenable(host: str, port: int) -> None:
    """ValueError where the server could not listen on host:port (an address this machine does
    not have, a port in use): found before the model loads, not after. The probe's socket is
    closed at once; the server binds its own."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host {host!r} is not an address to listen on: {err}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}") from None


def serve_decoder(args: argparse.Namespace):
    """The SpeculativeDecoder `verispec serve`'s flags name (model names resolved here)."""
    from verispec import SpeculativeDecoder

    return SpeculativeDecoder.from_config(engine_config(args, k=args.k))
