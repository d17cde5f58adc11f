"""Prefix reuse across requests (verispec.scheduler): where the target's caches are exact for any
cut into passes (GGUF models on the native runtime), a request starts from the cache an earlier
request left for the start of the prompt they share, feeds only the rest, and its output is the
same bits as from an empty cache; only requests of one lookup scope share; another request's
cache survives a prompt that shares only its start; a runtime without the guarantee never
shares; a seeded sampled row starts clean; the caches of requests that left stay within their
memory bound, and a request waits until its caches fit."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import EOS_ID, tiny_llama
from openai import OpenAI
from test_gguf import write_tiny_gguf
from test_server import running

from verispec import SamplingParams, SpeculativeDecoder
from verispec.config import DecodeConfig
from verispec.drafters.drafter import cache_bytes
from verispec.engine import Engine
from verispec.quant.gguf import read
from verispec.quant.quantized_model import GGUFModel
from verispec.runtime.hf import HFRunner
from verispec.runtime.native.gguf_model import GGUFLlama, gguf_runner
from verispec.runtime.native.llama import NativeLlama
from verispec.runtime.native.native_runner import NativeRunner
from verispec.server import ServerConfig, create_app

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=5)
INVARIANT = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=5,
                           verify="invariant")
START = list(range(3, 60))  # 57 ids the prompts below open with
PROMPT_A = START + [70, 71, 72, 73]
PROMPT_B = START + [80, 81]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / "tiny.gguf"
    write_tiny_gguf(path, tokenizer=True)
    return path


@pytest.fixture(scope="module")
def decoder(tiny_file):
    return SpeculativeDecoder.from_pretrained(tiny_file, draft="ngram", k=3, dequantize=None)


@pytest.fixture
def fed(monkeypatch):
    """The positions each target pass feeds, per row, in order: a list of lists."""
    passes: list[list[int]] = []
    forward_rows = GGUFLlama.forward_rows

    def spy(model, rows, inputs=None):
        passes.append([int(row.ids.numel()) for row in rows])
        return forward_rows(model, rows, inputs)

    monkeypatch.setattr(GGUFLlama, "forward_rows", spy)
    return passes


def alone(decoder, prompt, params) -> list[int]:
    engine = decoder.engine(1)
    request = engine.add_request(prompt, params)
    return engine.run()[request].token_ids


def run(engine, prompt, params):
    request = engine.add_request(prompt, params)
    return engine.run()[request]


@pytest.mark.parametrize("params", [GREEDY, INVARIANT], ids=["greedy", "seeded invariant"])
def test_a_request_feeds_only_what_an_earlier_requests_cache_lacks(decoder, fed, params):
    engine = decoder.engine(4)
    first = run(engine, PROMPT_A, params)
    assert first.stats.cached_prompt_tokens == 0
    fed.clear()
    second = run(engine, PROMPT_B, params)
    assert second.stats.cached_prompt_tokens == len(START)
    assert fed[0] == [len(PROMPT_B) - len(START)]  # its first pass: the prompt's rest only
    # the same bits as from an empty cache
    assert second.token_ids == alone(decoder, PROMPT_B, params)
    assert first.token_ids == alone(decoder, PROMPT_A, params)
    # the same prompt again: all but its last position, which gives the first token's logits
    again = run(engine, PROMPT_B, params)
    assert again.stats.cached_prompt_tokens == len(PROMPT_B) - 1
    assert again.token_ids == second.token_ids


def test_other_scopes_and_no_scope_share_nothing(decoder):
    engine = decoder.engine(4)
    scoped = {scope: SamplingParams(max_new_tokens=8, lookup_scope=scope)
              for scope in ("key:a", "key:b", None)}
    run(engine, PROMPT_A, scoped["key:a"])
    assert run(engine, PROMPT_B, scoped["key:b"]).stats.cached_prompt_tokens == 0
    assert run(engine, PROMPT_B, scoped[None]).stats.cached_prompt_tokens == 0
    assert run(engine, PROMPT_B, scoped[None]).stats.cached_prompt_tokens == 0  # nor each other
    assert run(engine, PROMPT_B, scoped["key:a"]).stats.cached_prompt_tokens == len(START)


def test_seeded_sampled_rows_start_clean(tiny_file, tmp_path):
    """A seeded sampled row's draws follow its drafts, and what it drafts when depends on the
    state it starts from, so it starts from empty caches (`starts_clean`) and answers as alone
    after any request: here after a greedy one on most of its prompt, with its prompt in
    chunks alone but not after, and a draft model that sits out a first round that would read
    the prompt (FIRST_ROUND_READ)."""
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=1)
    config = DecodeConfig(prefill_chunk=64, prefill_knee=10**6)
    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}", k=3,
                                                 dequantize=None, config=config)
    prompt = torch.randint(3, 90, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = alone(decoder, prompt, SEEDED)
    engine = decoder.engine(2)
    run(engine, prompt[:80], SamplingParams(max_new_tokens=4, ignore_eos=True))
    after = run(engine, prompt, SEEDED)
    assert after.stats.cached_prompt_tokens == 0 and after.token_ids == expected
    # the decoder's own runner (a lone prompt) starts clean for it too
    decoder.generate(prompt[:80], GREEDY)
    own = decoder.generate(prompt, SEEDED)
    assert own.stats.cached_prompt_tokens == 0 and own.token_ids == expected
    # and a greedy row after it reuses what it left
    assert run(engine, prompt, GREEDY).stats.cached_prompt_tokens == len(prompt) - 1


def feature_decoder(tiny_file, k: int = 3, tree_width: int = 8) -> SpeculativeDecoder:
    """The tiny GGUF model with a randomly initialised feature draft, K fixed."""
    from verispec.distill.feature_head import FeatureHead
    from verispec.drafters.feature import FeatureDrafter
    from verispec.runtime.native.shape import LlamaShape

    model = GGUFModel(read(tiny_file))
    tokenizer = SpeculativeDecoder.from_pretrained(tiny_file, draft=None,
                                                   dequantize=None).tokenizer
    torch.manual_seed(0)
    head = FeatureHead(LlamaShape.from_config(model.config))
    for weight in head.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.02)
    vocab = int(model.config.vocab_size)
    drafter = FeatureDrafter(head.state_dict(), torch.arange(vocab), model, vocab,
                             tree_width=tree_width)
    return SpeculativeDecoder(model, tokenizer, drafter, k=k, runtime="native")


def test_a_feature_draft_over_a_reused_cache(tiny_file):
    """A feature draft reads the target's features and taps, which a copied start carries:
    greedy rows answer as alone, and a seeded row whose whole prompt is cached (where a feature
    draft could draft in its first round, alone it cannot) starts clean."""
    decoder = feature_decoder(tiny_file)
    engine = decoder.engine(3)
    run(engine, PROMPT_A, GREEDY)
    second = run(engine, PROMPT_B, GREEDY)
    assert second.stats.cached_prompt_tokens == len(START) and second.stats.drafted > 0
    assert second.token_ids == alone(decoder, PROMPT_B, GREEDY)
    assert all(cache_bytes(slot.drafter) > 0 for slot in engine.scheduler._free)  # its layer's
    # a conversation's next turn counts the whole answer cached, the path of the token tree
    # its last round verified included (all of it but the last token, never fed)
    for prompt in (PROMPT_A, PROMPT_B):
        first = run(engine, prompt, GREEDY)
        next_turn = prompt + first.token_ids + [90, 91]
        again = run(engine, next_turn, GREEDY)
        assert again.stats.cached_prompt_tokens == len(prompt) + len(first.token_ids) - 1
        assert again.token_ids == alone(decoder, next_turn, GREEDY)
    for seed in range(3):
        params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=seed)
        first, again = run(engine, PROMPT_A, params), run(engine, PROMPT_A, params)
        assert again.stats.cached_prompt_tokens == 0 and again.token_ids == first.token_ids


def test_a_start_copied_from_a_draft_that_never_ran(tiny_file, tmp_path):
    """A request that ended before its draft model read anything (one token) leaves a slot
    whose draft cache is empty; a prompt sharing its start copies the target's part and starts
    the draft empty."""
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=1)
    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}", k=3,
                                                 dequantize=None)
    engine = decoder.engine(4)
    run(engine, START + list(range(60, 90)), SamplingParams(max_new_tokens=1))
    second = run(engine, PROMPT_B, GREEDY)
    assert second.stats.cached_prompt_tokens == len(START)
    assert second.token_ids == alone(decoder, PROMPT_B, GREEDY)


def test_a_conversation_keeps_its_cache_when_another_shares_its_start(decoder):
    engine = decoder.engine(2)
    first = run(engine, PROMPT_A, GREEDY)
    run(engine, PROMPT_B, GREEDY)  # shares START only: served from a copy of it
    next_turn = PROMPT_A + first.token_ids + [90, 91]
    # A's cache kept all of its prompt and output (but the output's last token, never fed)
    assert run(engine, next_turn, GREEDY).stats.cached_prompt_tokens >= len(PROMPT_A) + 23
    # two more prompts that share nothing: a pool of max_batch runners, the oldest emptied
    for prompt in ([61, 62, 63] * 5, [64, 65] * 8):
        assert run(engine, prompt, GREEDY).stats.cached_prompt_tokens == 0
    assert engine.scheduler._pooled == 2


def test_a_runtime_without_exact_prefixes_starts_empty(tokenizer):
    model = tiny_llama(EOS_ID + 1, seed=4, dtype=torch.float32)
    decoder = SpeculativeDecoder(model, tokenizer, None, runtime="native")
    assert not decoder.target.exact_prefixes  # a long prompt pass rounds unlike short ones
    engine = decoder.engine(4)
    ids = [5, 9, 14, 2, 2, 71, 30] * 6
    first = run(engine, ids, GREEDY)
    second = run(engine, ids + [3], GREEDY)
    assert second.stats.cached_prompt_tokens == 0
    assert first.token_ids == alone(decoder, ids, GREEDY)
    # the decoder's own runner too: the same prompt again is computed afresh (reusing it
    # recomputed the last position alone, in other bits than the prompt's pass gave it, and
    # the embedded model's greedy answer to one prompt changed from one call to the next)
    again = [decoder.generate(ids, GREEDY) for _ in range(2)]
    assert again[1].stats.cached_prompt_tokens == 0
    assert again[0].token_ids == again[1].token_ids


def test_copy_prefix_holds_the_sources_bits(tiny_file):
    model = GGUFModel(read(tiny_file))
    source, copy, fresh = (gguf_runner(model) for _ in range(3))
    assert source.exact_prefixes
    ids = torch.tensor(PROMPT_A)
    source.logits(ids, 1)
    copy.logits(torch.tensor([7, 7, 7]), 1)  # another sequence first: forgotten
    copy.copy_prefix(source, len(START))
    assert copy.cached_ids.tolist() == START
    n = len(START)
    assert torch.equal(copy.cache.keys[:, :, :n], source.cache.keys[:, :, :n])
    assert torch.equal(copy.cache.values[:, :, :n], source.cache.values[:, :, :n])
    assert torch.equal(copy.cache.features[:n], source.cache.features[:n])  # a feature draft's
    assert torch.equal(copy.logits(torch.tensor(PROMPT_B), 1),
                       fresh.logits(torch.tensor(PROMPT_B), 1))
    with pytest.raises(ValueError, match="holds"):
        copy.copy_prefix(source, len(PROMPT_A) + 1)
    other = NativeRunner(NativeLlama.from_hf(tiny_llama(EOS_ID + 1, seed=1), torch.float32))
    with pytest.raises(ValueError, match="own model"):
        copy.copy_prefix(other, 3)


def test_the_server_reports_cached_tokens_per_api_key(decoder):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, and the Prometheus counter; a
    request with another key reuses nothing of the first key's prompt."""
    app = create_app(decoder, "tiny", ServerConfig(suffix_cache="per-key"))
    prompt = "the cat sat on the mat, and then the dog sat on the cat. " * 2

    def complete(url, key, text):
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        reply = client.completions.create(model="tiny", prompt=text, max_tokens=8,
                                          temperature=0)
        return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

    with running(app) as url:
        text, cached = complete(url, "key-a", prompt + "first")
        assert cached == 0
        _, cached = complete(url, "key-b", prompt + "second")
        assert cached == 0
        again, repeated = complete(url, "key-a", prompt + "first")
        assert repeated == len(decoder.encode(prompt + "first", False)) - 1 and again == text
        _, shared = complete(url, "key-a", prompt + "third")
        assert shared >= len(decoder.encode(prompt, False)) - 1
        counted = next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                       if line.startswith("verispec_prompt_tokens_cached_total"))
        assert float(counted.split()[-1]) == repeated + shared
        idle = next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("verispec_idle_cache_bytes "))
        assert float(idle.split()[-1]) > 0  # the finished requests' caches, kept


@pytest.mark.parametrize("params", [GREEDY, INVARIANT], ids=["greedy", "seeded invariant"])
def test_a_copied_start_reaches_the_draft_model_too(tiny_file, tmp_path, params):
    """A prompt sharing only the start of another's cache gets a copy of that start, in the
    target's cache and in the draft model's: neither computes it again, and the output is the
    same bits as from empty caches."""
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=1)
    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}", k=3,
                                                 dequantize=None)
    draft_model = decoder.drafter.model.runner.model
    engine = decoder.engine(4)
    run(engine, PROMPT_A, params)
    read: list[int] = []  # the positions of each of the draft model's passes
    forward_rows, greedy_chain = GGUFLlama.forward_rows, GGUFLlama.greedy_chain

    def spy(model, rows, inputs=None):
        if model is draft_model:
            read.extend(int(row.ids.numel()) for row in rows)
        return forward_rows(model, rows, inputs)

    def chain_spy(model, cache, start, unread, *args, **kwargs):  # its first pass's
        if model is draft_model:
            read.append(len(unread))
        return greedy_chain(model, cache, start, unread, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GGUFLlama, "forward_rows", spy)
        patch.setattr(GGUFLlama, "greedy_chain", chain_spy)
        second = run(engine, PROMPT_B, params)
    assert second.stats.cached_prompt_tokens == len(START)
    assert read and read[0] <= len(PROMPT_B) - len(START)  # the draft's first pass: the rest
    assert second.token_ids == alone(decoder, PROMPT_B, params)


def test_requests_joining_a_busy_engine_answer_as_alone(tiny_file, tmp_path):
    """24 requests over three shared starts, greedy and seeded, joining a 3-row engine while
    it runs: slots are reused as they are, copied and emptied, and every answer is the one the
    request gets alone."""
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=2)
    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}", k=3,
                                                 dequantize=None)
    generator = torch.Generator().manual_seed(0)
    starts = [torch.randint(3, 90, (length,), generator=generator).tolist()
              for length in (40, 25, 60)]
    jobs = []
    for index in range(24):
        tail = torch.randint(3, 90, (index % 5 + 1,), generator=generator).tolist()
        params = GREEDY if index % 2 else SamplingParams(
            max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=index)
        jobs.append((starts[index % 3] + tail, params))
    engine = decoder.engine(3)
    ids, outputs, waiting = {}, {}, list(jobs)
    while waiting or engine.has_work:
        for _ in range(2 if waiting else 0):  # two join every round while any are left
            prompt, params = waiting.pop(0)
            ids[engine.add_request(prompt, params)] = (prompt, params)
            if not waiting:
                break
        for event in engine.step():
            if event.output is not None:
                outputs[event.request_id] = event.output
    greedy = [outputs[i] for i, (_, params) in ids.items() if params.greedy]
    assert sum(output.stats.cached_prompt_tokens > 0 for output in greedy) >= 4
    for request_id, (prompt, params) in ids.items():
        assert outputs[request_id].token_ids == alone(decoder, prompt, params), request_id


def test_a_load_test_of_conversations_finds_their_turns_cached(tiny_file):
    """`python -m verispec.server.loadtest --turns 3`: each conversation's later turns resend
    it whole, and the server computes only what is new."""
    from test_server import CHAT_TEMPLATE

    from verispec.server.loadtest import run_load

    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft="ngram", k=3, dequantize=None)
    decoder.tokenizer.chat_template = CHAT_TEMPLATE
    with running(create_app(decoder, "tiny", ServerConfig())) as url:
        report = run_load(f"{url}/v1", requests=8, concurrency=2,
                          prompts=("the cat sat on the mat", "one two three four"),
                          max_tokens=12, turns=3)
    summary = report.summary()
    assert summary["ok"] == 8 and len(summary["ttft_p50_by_turn_s"]) == 3
    assert [r.turn for r in report.results] == [0, 1, 2, 0, 1, 2, 0, 1]
    later = [r for r in report.results if r.turn > 0]
    assert all(r.cached_tokens > 20 for r in later)  # at least the first turn's prompt
    assert summary["cached_prompt_tokens"] == sum(r.cached_tokens for r in report.results)
    with pytest.raises(ValueError, match="turns"):
        run_load("http://127.0.0.1:9/v1", requests=2, concurrency=1, turns=2, mixed=True)


def test_requests_arriving_together_compute_a_shared_start_once(tiny_file, fed):
    """Three prompts opening with the same 120 tokens, sent at once: the first computes the
    start (in chunks), the others wait for it and copy it, and each answers as alone."""
    config = DecodeConfig(prefill_chunk=32, prefill_knee=10**6)
    decoder = SpeculativeDecoder.from_pretrained(tiny_file, draft="ngram", k=3, dequantize=None,
                                                 config=config)
    start = torch.randint(3, 90, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [start + [60 + i, 61 + i, 62 + i] for i in range(3)]
    engine = decoder.engine(4)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    fed.clear()
    outputs = engine.run()
    computed = sum(sum(rows) for rows in fed)  # positions through the target, all rows
    assert [outputs[i].stats.cached_prompt_tokens for i in ids] == [0, 120, 120]
    assert computed < 2 * len(prompts[0]) + 3 * 24 * 4  # the start once (drafts: 4 a token)
    for i, prompt in zip(ids, prompts, strict=True):
        assert outputs[i].token_ids == alone(decoder, prompt, GREEDY)


def test_a_request_whose_admission_fails_fails_alone(decoder, monkeypatch):
    """A request that raises while it joins (here: copying its start) leaves with its error;
    the request beside it answers as alone, and the pool goes on serving."""
    engine = decoder.engine(4)
    run(engine, PROMPT_A, GREEDY)  # leaves START in a free cache
    copy_prefix = NativeRunner.copy_prefix

    def broken(runner, source, length):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(NativeRunner, "copy_prefix", broken)
    failing = engine.add_request(PROMPT_B, GREEDY)  # shares START only: copied
    other = engine.add_request([61, 62, 63] * 5, GREEDY)  # shares nothing
    errors, outputs = {}, {}
    while engine.has_work:
        for event in engine.step():
            if event.error is not None:
                errors[event.request_id] = event.error
            elif event.output is not None:
                outputs[event.request_id] = event.output
    assert set(errors) == {failing} and "copy failed" in str(errors[failing])
    assert outputs[other].token_ids == alone(decoder, [61, 62, 63] * 5, GREEDY)
    monkeypatch.setattr(NativeRunner, "copy_prefix", copy_prefix)
    assert run(engine, PROMPT_B, GREEDY).token_ids == alone(decoder, PROMPT_B, GREEDY)
    pool = engine.scheduler
    assert len(pool._free) == pool._pooled  # every runner made is back in the pool


def test_a_runners_cache_bytes_count_what_it_keeps(tiny_file, tokenizer, tmp_path):
    """A native runner keeps its buffers through a reset (and says so); a transformers runner
    drops them; a hybrid drafter counts its draft model's cache."""
    runner = gguf_runner(GGUFModel(read(tiny_file)))
    assert runner.cache_bytes == 0
    runner.logits(torch.tensor(PROMPT_A), 1)
    held, shape = runner.cache_bytes, runner.model.shape
    assert held >= len(PROMPT_A) * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4 * 2
    runner.reset()
    assert runner.cache_bytes == held
    hf = HFRunner(tiny_llama(EOS_ID + 1, seed=4, dtype=torch.float32))
    hf.logits(torch.tensor(PROMPT_A), 1)
    config = hf.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    buffers = config.num_hidden_layers * 2 * config.num_key_value_heads * 256 * head_dim * 4
    assert hf.cache_bytes == buffers  # whole buffers of 256 positions, not their views
    hf.rollback(5)
    assert hf.cache_bytes == buffers
    hf.reset()
    assert hf.cache_bytes == 0
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=1)
    drafter = SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}",
                                                 dequantize=None).drafter
    assert cache_bytes(drafter) == 0 and cache_bytes(None) == 0
    drafter.model.catch_up(torch.tensor(PROMPT_A))
    assert cache_bytes(drafter) == drafter.model.runner.cache_bytes > 0


def test_the_caches_of_requests_that_left_stay_within_their_bound(decoder):
    """Unrelated prompts, one after another: without a bound the pool keeps a cache for each;
    with one, the free caches hold at most that many bytes, the least recently used dropped
    first, and every answer is still the one alone."""
    prompts = [[(7 * j + 11 * i) % 89 + 3 for j in range(30 + 6 * i)] for i in range(4)]
    unbounded = decoder.engine(4, idle_cache_bytes=1 << 40)
    for prompt in prompts:
        run(unbounded, prompt, GREEDY)
    pool = unbounded.scheduler
    assert pool._pooled == len(pool._free) == 4
    sizes = [slot.runner.cache_bytes for slot in pool._free]  # by prompt, least recent first
    assert pool.idle_bytes == sum(sizes) and min(sizes) > 0
    room = sizes[-2] + sizes[-1]  # the two most recent
    engine = decoder.engine(4, idle_cache_bytes=room)
    for prompt in prompts:
        assert run(engine, prompt, GREEDY).token_ids == alone(decoder, prompt, GREEDY)
        assert 0 < engine.scheduler.idle_bytes <= room
    assert engine.scheduler._pooled == len(engine.scheduler._free) == 2
    # the most recent prompt's next turn starts from its cache; the first one's afresh
    assert run(engine, prompts[-1] + [90], GREEDY).stats.cached_prompt_tokens > 0
    assert run(engine, prompts[0] + [90], GREEDY).stats.cached_prompt_tokens == 0


def test_no_room_keeps_nothing_but_the_decoders_own_runner(decoder):
    engine = Engine(decoder._model(), max_batch=2, runners=[decoder.target],
                    idle_cache_bytes=0)
    first = run(engine, PROMPT_A, GREEDY)
    assert [slot.runner for slot in engine.scheduler._free] == [decoder.target]
    second = run(engine, PROMPT_B, GREEDY)  # on a new pooled runner, dropped as it leaves
    assert [slot.runner for slot in engine.scheduler._free] == [decoder.target]
    assert engine.scheduler._pooled == 0 and engine.scheduler.idle_bytes == 0
    assert second.token_ids == alone(decoder, PROMPT_B, GREEDY)
    assert first.token_ids == alone(decoder, PROMPT_A, GREEDY)
    with pytest.raises(ValueError, match="idle_cache_bytes"):
        decoder.engine(2, idle_cache_bytes=-1)
    with pytest.raises(ValueError, match="idle_cache_bytes"):
        ServerConfig(idle_cache_bytes=-1)


def drive(engine, cancel_at: dict[int, int] | None = None):
    """Step an engine to the end -> (outputs, ids in the order they joined, the most rows that
    ran together, the sets of rows that ran together); each running row's caches stay within
    what it was priced at. cancel_at: {step: request id} cancelled before that step."""
    outputs, joined, most, together = {}, [], 0, []
    for step in range(1000):  # never stuck waiting for room
        if not engine.has_work:
            break
        if cancel_at and step in cancel_at:
            engine.cancel(cancel_at[step])
        for event in engine.step():
            if event.output is not None:
                outputs[event.request_id] = event.output
        pool = engine.scheduler
        running = [r.request_id for r in pool.running]
        for r in pool.running:
            assert r.runner.cache_bytes + cache_bytes(r.drafter) <= pool._reserved[r.request_id]
        joined += [i for i in running if i not in joined]
        most = max(most, len(running))
        together.append(set(running))
    assert not engine.has_work
    return outputs, joined, most, together


def test_a_request_waits_until_its_caches_fit(decoder):
    """With room for one request's caches, three requests run one after another (each joins as
    the last leaves), in order, and answer as alone; with room for all, they run together; a
    request bigger than the room still runs, alone. A request is priced at its prompt, budget
    and a round's drafts, in whole blocks, and its caches stay within that."""
    prompts = [[(5 * j + 13 * i) % 89 + 3 for j in range(40)] for i in range(3)]
    need = 128 * decoder.target.bytes_per_position  # 40 + 24 + 64 positions: two blocks of 64
    for room, together in ((need + need // 2, 1), (3 * need, 3), (need // 2, 1)):
        engine = decoder.engine(4, cache_memory=room)
        ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
        assert [engine.scheduler._need(r) for r in engine.scheduler.waiting] == [need] * 3
        outputs, joined, most, _ = drive(engine)
        assert most == together and joined == ids, room
        for i, prompt in zip(ids, prompts, strict=True):
            assert outputs[i].token_ids == alone(decoder, prompt, GREEDY)
        assert engine.scheduler.idle_bytes <= room
    with pytest.raises(ValueError, match="cache_memory"):
        decoder.engine(2, cache_memory=-1)


def test_room_comes_back_as_rows_leave_in_order(decoder):
    """Room for two: a short request leaves first and the third joins beside the long one still
    running (its room was given back); a request that does not fit is not overtaken by a smaller
    one behind it; a cancelled row gives its room back too."""
    prompt = [(5 * j) % 89 + 3 for j in range(40)]
    short, long = (SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 60))
    engine = decoder.engine(4)
    ids = [engine.add_request(prompt, p) for p in (short, long, long)]
    needs = [engine.scheduler._need(r) for r in engine.scheduler.waiting]
    assert needs[0] < needs[1] == needs[2]
    engine.scheduler.cache_memory = needs[1] + needs[2]  # the short one and a long one fit
    _, joined, most, together = drive(engine)
    assert joined == ids and most == 2 and {ids[1], ids[2]} in together
    # a big head waits for room, and the small request behind it waits with it
    engine = decoder.engine(4)
    ids = [engine.add_request(prompt, p) for p in (long, long, short)]
    needs = [engine.scheduler._need(r) for r in engine.scheduler.waiting]
    engine.scheduler.cache_memory = needs[0] + needs[2]  # the short one would fit
    _, joined, most, together = drive(engine)
    assert joined == ids and most == 2 and {ids[0], ids[2]} not in together
    # room for one: cancelling the running row lets the next join
    engine = decoder.engine(4)
    ids = [engine.add_request(prompt, p) for p in (long, long)]
    engine.scheduler.cache_memory = engine.scheduler._need(engine.scheduler.waiting[0])
    outputs, joined, _, together = drive(engine, cancel_at={3: ids[0]})
    assert joined == ids and ids[0] not in outputs and together[3] == {ids[1]}


def test_a_rows_caches_with_a_drafter_stay_within_its_price(tiny_file, tmp_path):
    """Target and drafter caches of every running row stay within what it was priced at: a
    short request on the slot a longer one left (a feature draft's cache is new at each
    admission, the target's already grown), wide and deep greedy trees that run the feature
    draft ahead of the target, a draft model; and caches grow freely once their row leaves."""
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, seed=1)
    decoders = [feature_decoder(tiny_file), feature_decoder(tiny_file, k=12, tree_width=8),
                SpeculativeDecoder.from_pretrained(tiny_file, draft=f"hybrid:{draft_file}", k=3,
                                                   dequantize=None)]
    long_prompt = [(7 * j) % 89 + 3 for j in range(120)]
    for decoder in decoders:
        engine = decoder.engine(1)
        for prompt, n in ((long_prompt, 60), ([5, 9, 14, 2], 6), (PROMPT_B, 24),
                          ([5, 9] * 20, 88)):
            engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        outputs, _, _, _ = drive(engine)  # asserts each row's caches within its price
        assert len(outputs) == 4
        for slot in engine.scheduler._free:
            assert slot.runner.cache.growth_limit is None
            draft_cache = getattr(getattr(slot.drafter, "model", slot.drafter), "cache", None)
            runner = getattr(getattr(slot.drafter, "model", None), "runner", None)
            assert getattr(draft_cache, "growth_limit", None) is None
            assert runner is None or runner.cache.growth_limit is None


def test_a_limited_cache_grows_on_past_its_limit(tiny_file):
    """A cache held to 64 positions takes a longer sequence all the same, doubling again, and
    gives the same logits as one without a limit."""
    model = GGUFModel(read(tiny_file))
    limited, free = gguf_runner(model), gguf_runner(model)
    limited.limit_growth(64)
    ids = torch.tensor([(3 * j) % 89 + 3 for j in range(150)])
    for end in (30, 60, 150):
        assert torch.equal(limited.logits(ids[:end], 1), free.logits(ids[:end], 1))
        assert limited.cache.keys.shape[2] == (64 if end <= 64 else 256)
