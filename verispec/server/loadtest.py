"""Fire N requests from C concurrent clients at a running server and print what came back.

    python -m verispec.server.loadtest --url http://127.0.0.1:8000/v1 --requests 64 \
        --concurrency 16 --max-tokens 64 [--temperature 0] [--chat] [--prompts FILE]

Each client (a thread with its own `openai` client) streams its requests one after another, so
C requests are in flight at once; time to first token is the first chunk with text, latency the
whole stream. Prints one JSON object: requests, concurrency, errors by status, latency and TTFT
percentiles, requests/s and generated tokens/s over the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PROMPTS = (
    "Explain in two sentences what a KV cache is.",
    "Write a Python function that reverses a string.",
    "List three uses of speculative decoding.",
    "Summarize: the meeting moved from Tuesday to Thursday because the room was booked.",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "What is the capital of Japan? Answer in one sentence.",
    "Give a short definition of entropy in information theory.",
    "Write a haiku about autumn rain.",
)


@dataclass(frozen=True, slots=True)
class Result:
    index: int  # the request's number: its prompt is prompts[index % len(prompts)]
    status: int  # 200, the error's HTTP status, or 0 when no response came
    text: str
    completion_tokens: int
    ttft_s: float | None
    latency_s: float


@dataclass(frozen=True, slots=True)
class Report:
    results: list[Result]
    concurrency: int
    wall_s: float

    def summary(self) -> dict:
        ok = [r for r in self.results if r.status == 200]
        errors: dict[str, int] = {}
        for result in self.results:
            if result.status != 200:
                errors[str(result.status)] = errors.get(str(result.status), 0) + 1
        latency = sorted(r.latency_s for r in ok)
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tokens = sum(r.completion_tokens for r in ok)
        return {
            "requests": len(self.results), "concurrency": self.concurrency, "ok": len(ok),
            "errors": errors, "wall_s": round(self.wall_s, 3),
            "latency_s": {f"p{q}": round(percentile(latency, q), 4) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": round(percentile(ttft, q), 4) for q in (50, 90, 99)},
            "requests_per_s": round(len(ok) / self.wall_s, 2),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / self.wall_s, 1),
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: [1, 2, 3, 4], q=50 -> 2; nan for no values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def run_load(base_url: str, requests: int, concurrency: int, prompts=PROMPTS,
             max_tokens: int = 64, temperature: float = 0.0, chat: bool = False,
             model: str | None = None) -> Report:
    """Send `requests` streaming requests, `concurrency` at a time; base_url ends with /v1."""
    from openai import OpenAI

    local = threading.local()

    def client() -> OpenAI:
        if not hasattr(local, "client"):
            local.client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
        return local.client

    model = model or client().models.list().data[0].id

    def one(index: int) -> Result:
        prompt = prompts[index % len(prompts)]
        started, ttft, pieces, tokens = time.perf_counter(), None, [], 0
        try:
            if chat:
                stream = client().chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens, temperature=temperature, stream=True,
                    stream_options={"include_usage": True})
            else:
                stream = client().completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                    stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    piece = choice.delta.content if chat else choice.text
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - started
                        pieces.append(piece)
            status = 200
        except Exception as err:  # counted by status in the report, never raised
            status = getattr(err, "status_code", 0)
        return Result(index, status, "".join(pieces), tokens, ttft,
                      time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    return Report(results, concurrency, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verispec.server.loadtest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--prompts", type=Path, default=None, help="a file, one prompt a line")
    args = parser.parse_args(argv)
    prompts = PROMPTS
    if args.prompts:
        prompts = tuple(line for line in args.prompts.read_text().splitlines() if line.strip())
    report = run_load(args.url, args.requests, args.concurrency, prompts, args.max_tokens,
                      args.temperature, args.chat)
    print(json.dumps(report.summary(), indent=2))


if __name__ == "__main__":
    main()
