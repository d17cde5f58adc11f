"""Fire N requests from C concurrent clients at a running server and print what came back.

    python -m verispec.server.loadtest --url http://127.0.0.1:8000/v1 --requests 64 \
        --concurrency 16 --max-tokens 64 [--temperature 0] [--chat] [--prompts FILE] [--mixed]
        [--api-key KEY] [--verify invariant] [--shared-files 4] [--turns 3]

Each client (a thread with its own `openai` client) streams its requests one after another, so
C requests are in flight at once; time to first token is the first chunk with text, latency the
whole stream. Prints one JSON object: requests, concurrency, errors by status, latency and TTFT
percentiles, requests/s and generated tokens/s over the run's wall time.

--mixed: request i is chat or completions, streamed or not, greedy or seeded (temperature 0.8)
by the bits of i, and every 16th client leaves after two chunks; each distinct request is first
sent alone, and the summary adds `lost` (no answer), `mixed` (a greedy answer other than its
solo answer: rows mixed up), `5xx`, and how many greedy and seeded answers equal their solo
ones (seeded ones need not under block or token verification: K, which the batch sets, moves
the draws; with --verify invariant they must, as the seeded requests then verify that way).

--long-prompt N: one more request, a prompt of about N tokens, arrives a second into the run;
the summary gives its status and the longest gap between two chunks of any other stream.

--shared-files N: prompts with repeated context, as an assistant over a code base sees them:
each of N of verispec's own source files (its first 1,500 characters) under each of a few
tasks (`shared_file_prompts`), request i taking prompt i mod their number, so requests share
files and later requests ask what earlier ones asked (a cross-request lookup's case).

--turns T: conversations (chat): a client sends a prompt, then T - 1 follow-ups (FOLLOW_UPS),
each with the whole conversation so far, as chat clients do; the summary adds the median time
to first token of each turn. Every summary counts the prompt tokens the server's cache already
held (`usage.prompt_tokens_details.cached_tokens`, where it says).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import verispec

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

# Files of verispec itself that --shared-files quotes, and what each prompt asks of its file.
SHARED_FILES = ("drafters/ngram.py", "theory.py", "text.py", "sampling.py", "stats.py",
                "params.py", "drafters/prediction.py", "request.py")
FILE_TASKS = (
    "Explain what this code does, function by function.",
    "Add a docstring to every function that lacks one and print the whole file.",
    "List every name this file defines, one a line, with a short description.",
    "Rewrite this file with type hints on every argument and print it.",
    "Write pytest tests for the functions in this file.",
    "Point out possible bugs in this code.",
    "Summarise this file in three sentences.",
    "Print the file's imports, then its functions' signatures.",
)
FILE_CHARS = 1500
# What a conversation's client says after each answer (--turns), in turn.
FOLLOW_UPS = ("Now make it shorter.", "Explain the key step in one sentence.",
              "Give one more example.", "What could go wrong?")


def shared_file_prompts(files: int) -> tuple[str, ...]:
    """Every task of FILE_TASKS over each of the first `files` SHARED_FILES (its first
    FILE_CHARS characters), file by file: prompts that share files and tasks."""
    if not 1 <= files <= len(SHARED_FILES):
        raise ValueError(f"files must be in [1, {len(SHARED_FILES)}], got {files}")
    root = Path(verispec.__file__).parent
    return tuple(f"```python\n{(root / name).read_text()[:FILE_CHARS]}\n```\n\n{task}"
                 for name in SHARED_FILES[:files] for task in FILE_TASKS)


@dataclass(frozen=True, slots=True)
class Job:
    """One request of a mixed run, chosen by the bits of its index."""

    index: int
    prompt: str
    chat: bool
    stream: bool
    seed: int | None  # None: greedy; else sampled at temperature 0.8 with this seed
    leave: bool  # read two chunks, then disconnect

    @classmethod
    def of(cls, index: int, prompts, mixed: bool, chat: bool) -> Job:
        prompt = prompts[index % len(prompts)]
        if not mixed:
            return cls(index, prompt, chat, True, None, False)
        return cls(index, prompt, chat=bool(index & 1), stream=bool(index & 2),
                   seed=7 if index & 4 else None, leave=index % 16 == 15)

    @property
    def solo_key(self) -> tuple:
        """What the answer depends on: requests with one key answer alike when alone."""
        return self.prompt, self.chat, self.seed


@dataclass(frozen=True, slots=True)
class Result:
    index: int  # the request's number: its prompt is prompts[index % len(prompts)]
    status: int  # 200, the error's HTTP status, or 0 when no response came
    text: str
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    job: Job | None = None
    gap_s: float = 0.0  # the longest wait between two chunks with text (streams)
    turn: int = 0  # the request's turn in its conversation (--turns), from 0
    cached_tokens: int = 0  # of its prompt, held by the server's cache (where it says)


@dataclass(frozen=True, slots=True)
class Report:
    results: list[Result]
    concurrency: int
    wall_s: float
    solo: dict | None = None  # Job.solo_key -> the text answered alone (mixed runs)
    long_prompt: Result | None = None

    def summary(self) -> dict:
        stayed = [r for r in self.results if r.job is None or not r.job.leave]
        ok = [r for r in stayed if r.status == 200]
        errors: dict[str, int] = {}
        for result in stayed:
            if result.status != 200:
                errors[str(result.status)] = errors.get(str(result.status), 0) + 1
        latency = sorted(r.latency_s for r in ok)
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tokens = sum(r.completion_tokens for r in ok)
        summary = {
            "requests": len(self.results), "concurrency": self.concurrency, "ok": len(ok),
            "errors": errors, "wall_s": round(self.wall_s, 3),
            "latency_s": {f"p{q}": round(percentile(latency, q), 4) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": round(percentile(ttft, q), 4) for q in (50, 90, 99)},
            "requests_per_s": round(len(ok) / self.wall_s, 2),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / self.wall_s, 1),
            "longest_gap_s": round(max((r.gap_s for r in ok), default=0.0), 4),
            "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        }
        turns = max((r.turn for r in ok), default=0) + 1
        if turns > 1:
            summary["ttft_p50_by_turn_s"] = [
                round(percentile(sorted(r.ttft_s for r in ok if r.turn == turn and
                                        r.ttft_s is not None), 50), 4) for turn in range(turns)]
        if self.long_prompt is not None:
            summary["long_prompt"] = {"status": self.long_prompt.status,
                                      "latency_s": round(self.long_prompt.latency_s, 3)}
        if self.solo is not None:
            greedy = [r for r in ok if r.job.seed is None]
            seeded = [r for r in ok if r.job.seed is not None]
            mixed = sum(r.text != self.solo[r.job.solo_key] for r in greedy)
            same_seeded = sum(r.text == self.solo[r.job.solo_key] for r in seeded)
            summary.update({
                "left_on_purpose": len(self.results) - len(stayed),
                "lost": sum(r.status == 0 for r in stayed),
                "5xx": sum(r.status >= 500 for r in stayed), "mixed": mixed,
                "greedy_equal_solo": f"{len(greedy) - mixed}/{len(greedy)}",
                "seeded_equal_solo": f"{same_seeded}/{len(seeded)}",
            })
        return summary


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: [1, 2, 3, 4], q=50 -> 2; nan for no values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def run_load(base_url: str, requests: int, concurrency: int, prompts=PROMPTS,
             max_tokens: int = 64, temperature: float = 0.0, chat: bool = False,
             model: str | None = None, mixed: bool = False, api_key: str = "none",
             long_prompt: int = 0, verify: str | None = None, turns: int = 1) -> Report:
    """Send `requests` requests, `concurrency` at a time; base_url ends with /v1. Streaming
    completions (chat: chat completions) at `temperature`, or a mix (see the module doc).
    verify: the seeded requests' verification procedure (the server's default if None).
    turns > 1: conversations of that many chat requests each (the module doc), `requests`
    in all (the last conversation cut short where they do not divide)."""
    if turns < 1 or (turns > 1 and mixed):
        raise ValueError("turns must be >= 1, and 1 with mixed")
    from openai import OpenAI

    local = threading.local()

    def client() -> OpenAI:
        if not hasattr(local, "client"):
            local.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        return local.client

    model = model or client().models.list().data[0].id
    jobs = [Job.of(index, prompts, mixed, chat) for index in range(requests)]
    solo = None
    if mixed:  # each distinct request alone first, one at a time
        firsts = {job.solo_key: job for job in reversed(jobs)}
        solo = {key: send(client(), model, job, max_tokens, temperature, verify).text
                for key, job in firsts.items()}

    def one(job: Job) -> Result:
        return send(client(), model, job, max_tokens, temperature, verify)

    def conversation(first: int) -> list[Result]:
        job, messages, results = jobs[first], [], []
        for turn in range(min(turns, requests - first)):
            said = job.prompt if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
            messages.append({"role": "user", "content": said})
            result = send(client(), model, Job(first + turn, said, True, True, None, False),
                          max_tokens, temperature, verify, messages=messages, turn=turn)
            results.append(result)
            if result.status != 200:
                break
            messages.append({"role": "assistant", "content": result.text})
        return results

    long_result: list[Result] = []

    def long_one() -> None:
        time.sleep(1.0)
        job = Job(-1, "the quick brown fox jumps over the lazy dog. " * (long_prompt // 10),
                  chat=False, stream=False, seed=None, leave=False)
        long_result.append(send(OpenAI(base_url=base_url, api_key=api_key, max_retries=0),
                                model, job, 8, 0.0))

    started = time.perf_counter()
    long_thread = threading.Thread(target=long_one)
    if long_prompt:
        long_thread.start()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        if turns == 1:
            results = list(pool.map(one, jobs))
        else:
            results = [result for talk in pool.map(conversation, range(0, requests, turns))
                       for result in talk]
    if long_prompt:
        long_thread.join()
    return Report(results, concurrency, time.perf_counter() - started, solo,
                  long_result[0] if long_result else None)


def send(client, model: str, job: Job, max_tokens: int, temperature: float,
         verify: str | None = None, messages: list[dict] | None = None,
         turn: int = 0) -> Result:
    """One request -> its Result (errors counted by status, never raised). messages: a chat
    conversation to send instead of the job's prompt alone."""
    started, ttft, pieces, tokens, gap, cached = time.perf_counter(), None, [], 0, 0.0, 0
    last = started
    args = dict(model=model, max_tokens=max_tokens, stream=job.stream,
                temperature=temperature if job.seed is None else 0.8, seed=job.seed)
    if job.seed is not None and verify is not None:
        args["extra_body"] = {"verify": verify}
    if job.stream:
        args["stream_options"] = {"include_usage": True}
    try:
        if job.chat:
            response = client.chat.completions.create(
                messages=messages or [{"role": "user", "content": job.prompt}], **args)
        else:
            response = client.completions.create(prompt=job.prompt, **args)
        if not job.stream:
            choice = response.choices[0]
            pieces.append(choice.message.content if job.chat else choice.text)
            tokens, ttft = response.usage.completion_tokens, time.perf_counter() - started
            cached = _cached(response.usage)
        for chunks, chunk in enumerate(response if job.stream else ()):
            if job.leave and chunks == 2:
                response.close()
                break
            if chunk.usage is not None:
                tokens, cached = chunk.usage.completion_tokens, _cached(chunk.usage)
            for choice in chunk.choices:
                piece = choice.delta.content if job.chat else choice.text
                if piece:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - started
                    else:
                        gap = max(gap, now - last)
                    last = now
                    pieces.append(piece)
        status = 200
    except Exception as err:  # counted by status in the report, never raised
        status = getattr(err, "status_code", 0)
    return Result(job.index, status, "".join(pieces), tokens, ttft,
                  time.perf_counter() - started, job, gap, turn, cached)


def _cached(usage) -> int:
    """usage.prompt_tokens_details.cached_tokens, 0 where the server does not say."""
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) or 0


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
    parser.add_argument("--mixed", action="store_true",
                        help="chat and completions, streamed or not, greedy and seeded, a few "
                             "clients that leave; answers compared with each request alone")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if any")
    parser.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                        help="also send one prompt of about this many tokens a second in")
    parser.add_argument("--verify", choices=("block", "token", "invariant"), default=None,
                        help="the seeded requests' verification procedure (--mixed)")
    parser.add_argument("--turns", type=int, default=1, metavar="T",
                        help="conversations of T chat requests, each resending the whole "
                             "conversation so far (implies --chat)")
    parser.add_argument("--shared-files", type=int, default=0, metavar="N",
                        help="prompts with repeated context: N source files, each under "
                             f"{len(FILE_TASKS)} tasks (instead of the built-in prompts)")
    args = parser.parse_args(argv)
    if args.turns < 1 or (args.turns > 1 and args.mixed):
        parser.error("--turns must be >= 1, and cannot go with --mixed")
    prompts = PROMPTS
    if args.prompts:
        prompts = tuple(line for line in args.prompts.read_text().splitlines() if line.strip())
    elif args.shared_files:
        prompts = shared_file_prompts(args.shared_files)
    report = run_load(args.url, args.requests, args.concurrency, prompts, args.max_tokens,
                      args.temperature, args.chat or args.turns > 1, mixed=args.mixed,
                      api_key=args.api_key, long_prompt=args.long_prompt, verify=args.verify,
                      turns=args.turns)
    print(json.dumps(report.summary(), indent=2))


if __name__ == "__main__":
    main()
