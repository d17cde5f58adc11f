"""llama.cpp's own binaries as benchmark methods, on the same GGUF files and prompt token ids.

- `llama.cpp`: plain decoding.
- `llama.cpp-draft`: its speculative mode with the same draft GGUF (`--spec-type draft-simple`),
  one method per setting of the sweep (`--spec-draft-n-max` x `--spec-draft-p-min`), labelled
  `llama.cpp-draft[n=3,p=0.75]`.

Each method is one `llama-server` process started on first use and kept for the whole run (its
load is not timed). Its /completion endpoint takes the prompt as token ids, so llama.cpp decodes
exactly the ids verispec's methods decode (no second tokenisation), and it returns the token ids
it generated and its own timings; the tokens/s are llama.cpp's: wall = prompt_ms + predicted_ms
(verispec's methods also pay their prompt pass), with its decode-only rate kept beside. The
generated token count is checked against the request. Greedy is temperature 0; sampling maps
temperature/top-k/top-p/min-p and turns llama.cpp's other default samplers off.

The binary is found in `--llama-cpp DIR` (DIR, DIR/bin or DIR/build/bin) or on PATH; when it is
absent, or the target or draft is not a GGUF file, the methods are skipped with a note.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from verispec import loading
from verispec.bench.bench_config import LLAMA_CPP_METHODS as METHODS
from verispec.bench.methods import MethodRun
from verispec.errors import ModelNotFoundError
from verispec.params import SamplingParams

PLAIN, DRAFT = METHODS
SERVER = "llama-server"
# (--spec-draft-n-max, --spec-draft-p-min): short and long drafts, each without and with
# llama.cpp's confidence cut (it stops drafting when the draft's top token is below p-min).
DEFAULT_SWEEP = ((3, 0.0), (3, 0.75), (8, 0.0), (8, 0.75))
CONTEXT = 4096  # KV slots of each server: the longest prompt plus its new tokens must fit
START_TIMEOUT_S = 600.0
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an http_proxy


class LlamaCppError(RuntimeError):
    """llama.cpp did not start, answered an error, or did not generate what was asked."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One llama-server: the target, and for speculative decoding the draft and its setting."""

    binary: Path
    model: Path
    threads: int
    draft: Path | None = None
    draft_max: int = 3
    draft_p_min: float = 0.0
    context: int = CONTEXT

    def __post_init__(self) -> None:
        if self.threads < 1 or self.context < 16:
            raise ValueError(f"threads must be >= 1 and context >= 16, got {self.threads}, "
                             f"{self.context}")
        if self.draft is not None and (self.draft_max < 1 or not 0 <= self.draft_p_min <= 1):
            raise ValueError(f"draft max >= 1 and p-min in [0, 1], got {self.draft_max}, "
                             f"{self.draft_p_min}")

    def command(self, port: int) -> list[str]:
        command = [str(self.binary), "-m", str(self.model), "-t", str(self.threads),
                   "-tb", str(self.threads), "-c", str(self.context), "-np", "1",
                   "--host", "127.0.0.1", "--port", str(port),
                   # every request pays its whole prompt, as verispec's methods do
                   "--no-cache-prompt", "-cram", "0"]
        if self.draft is not None:
            command += ["-md", str(self.draft), "--spec-type", "draft-simple",
                        "--spec-draft-n-max", str(self.draft_max),
                        "--spec-draft-p-min", f"{self.draft_p_min:g}",
                        "-td", str(self.threads), "-tbd", str(self.threads)]
        return command


def find_binary(directory: str | os.PathLike | None, name: str = SERVER) -> Path | None:
    """`name` in DIR, DIR/bin or DIR/build/bin, or on PATH when no DIR is given."""
    if directory is None:
        found = shutil.which(name)
        return Path(found) if found else None
    root = Path(directory).expanduser()
    for folder in (root, root / "bin", root / "build" / "bin"):
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class LlamaServer:
    """A llama-server child process on a free local port; stopped by close(), when this object
    goes (the bench's methods go when run_bench returns), or at exit."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    def start(self) -> None:
        if self.process is not None:
            return
        self.port = _free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)
        self.process = subprocess.Popen(self.spec.command(self.port), stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT)
        weakref.finalize(self, _stop, self.process)
        deadline = time.monotonic() + START_TIMEOUT_S
        # the model is loaded when /health answers 200 (503 while loading)
        while True:
            if self.process.poll() is not None:
                status, self.process = self.process.returncode, None
                raise LlamaCppError(f"{self.spec.binary.name} exited with status {status} "
                                    f"while starting: {self.log_tail()}")
            try:
                with LOCAL.open(self._url("/health"), timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise LlamaCppError(f"{self.spec.binary.name} did not become ready in "
                                    f"{START_TIMEOUT_S:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def complete(self, request: dict) -> dict:
        self.start()
        body = json.dumps(request).encode()
        http = urllib.request.Request(self._url("/completion"), data=body,
                                      headers={"Content-Type": "application/json"})
        try:
            with LOCAL.open(http, timeout=3600) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as err:
            raise LlamaCppError(f"llama-server answered {err.code}: "
                                f"{err.read().decode(errors='replace')[:500]}") from None
        except (urllib.error.URLError, ConnectionError) as err:
            raise LlamaCppError(f"llama-server failed ({err}): {self.log_tail()}") from None

    def log_tail(self, lines: int = 8) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def close(self) -> None:
        if self.process is not None:
            _stop(self.process)
        self.process = None

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def completion_request(prompt_ids: list[int], params: SamplingParams) -> dict:
    """A /completion request that decodes as verispec does: these ids, this many tokens, the
    same sampling law (llama.cpp's default top-k 40, top-p 0.95, min-p 0.05 switched off)."""
    request = dict(prompt=list(prompt_ids), n_predict=params.max_new_tokens,
                   ignore_eos=params.ignore_eos, cache_prompt=False, return_tokens=True,
                   stream=False, temperature=0.0 if params.greedy else params.temperature,
                   top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                   repeat_penalty=1.0, typical_p=1.0)
    if params.seed is not None:
        request["seed"] = params.seed % 2**32
    return request


class LlamaCppMethod:
    runtime = "llama.cpp"

    def __init__(self, name: str, server: LlamaServer) -> None:
        self.name = name
        self.server = server

    def run(self, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
        if len(prompt_ids) + params.max_new_tokens > self.server.spec.context:
            raise ValueError(f"{self.name}: prompt of {len(prompt_ids)} tokens + "
                             f"{params.max_new_tokens} new ones exceed llama.cpp's context "
                             f"of {self.server.spec.context}")
        answer = self.server.complete(completion_request(prompt_ids, params))
        return parse_completion(self.name, answer, len(prompt_ids), params,
                                speculative=self.server.spec.draft is not None)


def parse_completion(name: str, answer: dict, prompt_tokens: int, params: SamplingParams,
                     speculative: bool) -> MethodRun:
    """llama-server's /completion answer -> MethodRun, checking the counts it reports.

    Example: tokens [5, 6], timings {prompt_n: 3, prompt_ms: 10, predicted_n: 2,
    predicted_ms: 40, predicted_per_second: 50} -> wall_s 0.05, 2 tokens, decode 50 tok/s."""
    tokens = answer.get("tokens")
    timings = answer.get("timings")
    if not isinstance(tokens, list) or not isinstance(timings, dict):
        raise LlamaCppError(f"{name}: the answer has no token ids or timings (a llama-server "
                            "without return_tokens?)")
    predicted = int(timings.get("predicted_n", -1))
    if predicted != len(tokens):
        raise LlamaCppError(f"{name}: llama.cpp timed {predicted} tokens but returned "
                            f"{len(tokens)}")
    if len(tokens) > params.max_new_tokens or (params.ignore_eos
                                               and len(tokens) != params.max_new_tokens):
        raise LlamaCppError(f"{name}: llama.cpp generated {len(tokens)} tokens, "
                            f"{params.max_new_tokens} were asked")
    if int(timings.get("prompt_n", prompt_tokens)) != prompt_tokens:
        # fewer means a cached prefix was reused: the run would not pay its whole prompt
        raise LlamaCppError(f"{name}: llama.cpp processed {timings.get('prompt_n')} prompt "
                            f"tokens of {prompt_tokens}")
    wall_s = (float(timings.get("prompt_ms", 0.0)) + float(timings["predicted_ms"])) / 1e3
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    return MethodRun(
        [int(t) for t in tokens], wall_s,
        # plain decoding makes one pass a token (the prompt pass gives the first); llama.cpp
        # does not report its speculative passes
        target_forwards=0 if speculative else len(tokens),
        accepted=int(accepted) if speculative and accepted is not None else None,
        checked=int(drafted) if speculative and drafted is not None else None,
        decode_tokens_per_s=float(timings.get("predicted_per_second") or 0.0) or None)


def build_methods(names: tuple[str, ...], binary_dir: str | os.PathLike | None,
                  target: Path | None, draft: Path | None, threads: int,
                  sweep: tuple[tuple[int, float], ...] = DEFAULT_SWEEP
                  ) -> tuple[list[LlamaCppMethod], list[str]]:
    """The llama.cpp methods among `names`, and notes for those skipped. target and draft: the
    GGUF files verispec's methods decode (None where it is not a GGUF file)."""
    wanted = [n for n in names if n in METHODS]
    if not wanted:
        return [], []
    binary = find_binary(binary_dir)
    where = f"in {binary_dir}" if binary_dir is not None else "on PATH"
    if binary is None:
        return [], [f"{', '.join(wanted)} skipped: no {SERVER} {where} (give --llama-cpp DIR)"]
    if target is None:
        return [], [f"{', '.join(wanted)} skipped: llama.cpp runs GGUF files and the target is "
                    "not one"]
    methods, notes = [], []
    if PLAIN in wanted:
        methods.append(LlamaCppMethod(PLAIN, LlamaServer(ServerSpec(binary, target, threads))))
    if DRAFT in wanted and draft is None:
        notes.append(f"{DRAFT} skipped: it needs a draft GGUF file (--draft NAME or PATH, or a "
                     "target whose default draft is one)")
    elif DRAFT in wanted:
        for draft_max, p_min in sweep:
            spec = ServerSpec(binary, target, threads, draft, draft_max, p_min)
            methods.append(LlamaCppMethod(f"{DRAFT}[n={draft_max},p={p_min:g}]",
                                          LlamaServer(spec)))
    notes.append(f"llama.cpp: {binary} ({threads} threads), llama-server fed the same prompt "
                 "token ids; its tokens/s include its prompt pass, as verispec's do")
    return methods, notes


def add_methods(config, methods: list, notes: list) -> None:
    """The bench's hook: append the llama.cpp methods `config` (a BenchConfig) asks for, on
    its target and draft, at the thread count verispec runs with."""
    import torch

    if not any(name in METHODS for name in config.methods):
        return
    draft = config.engine.draft
    if draft == "default":
        draft = loading.default_draft(config.engine.target)
    found, found_notes = build_methods(config.methods, config.llama_cpp,
                                       gguf_file(config.engine.target),
                                       None if draft is None else gguf_file(draft),
                                       torch.get_num_threads())
    methods.extend(found)
    notes.extend(found_notes)


def gguf_file(spec) -> Path | None:
    """The GGUF file a model spec (name, path, None = the embedded model) resolves to; None
    for a checkpoint folder or a spec that is not a model."""
    try:
        source = loading.resolve(spec)
    except ModelNotFoundError:
        return None
    return source.folder / source.gguf_file if source.gguf_file else None
