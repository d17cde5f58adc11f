"""The one decode loop: a lone prompt is a batch of one; a failing row fails alone; a long
prompt is fed in chunks, its drafter reading it a chunk a round too, without stalling the other
rows; a draft asked for nothing is not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import EOS_ID, feature_drafter, perturbed_copy, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.config import DecodeConfig
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.drafters.feature import _FeatureModel
from verispec.engine import Engine
from verispec.runtime import HFRunner, make_runner

POISON = 7  # a token id no prompt below holds, except the poisoned one
PROMPTS = ["hello world, hello world", "abcabcabc abc", "the cat sat on the mat, the cat"]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
SHORT = "hi there"  # shorter than a prefill chunk: it decodes from its first round


class PoisonedLookup(NgramDrafter):
    """n-gram lookup that raises on a history holding POISON: a row whose round fails."""

    def propose(self, history, k, params, generator):
        if POISON in history.tolist():
            raise RuntimeError("poisoned row")
        return super().propose(history, k, params, generator)

    def fork(self):
        return PoisonedLookup()


def run_events(engine: Engine) -> tuple[dict, dict, dict]:
    """Step to the end -> (ids by request, text pieces by request, errors by request)."""
    ids, texts, errors = {}, {}, {}
    while engine.has_work:
        for event in engine.step():
            ids.setdefault(event.request_id, []).extend(event.token_ids)
            texts.setdefault(event.request_id, []).append(event.text)
            if event.error is not None:
                errors[event.request_id] = event.error
    return ids, texts, errors


def test_a_lone_prompt_is_a_batch_of_one(text_target, tokenizer):
    """generate() and a one-row engine give the same tokens and text, and a batch gives
    every row its solo output."""
    decoder = SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k=3)
    solo = [decoder.generate(p, PARAMS) for p in PROMPTS]
    engine = decoder.engine(max_batch=1)
    rids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    ids, texts, _ = run_events(engine)
    assert [ids[r] for r in rids] == [o.token_ids for o in solo]
    assert ["".join(texts[r]) for r in rids] == [o.text for o in solo]
    assert [o.token_ids for o in decoder.generate(PROMPTS, PARAMS)] == [o.token_ids for o in solo]


def test_a_row_that_raises_fails_alone_and_the_others_go_on(text_target, tokenizer):
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    solo = [plain.generate(p, PARAMS) for p in PROMPTS]
    decoder = SpeculativeDecoder(text_target, tokenizer, PoisonedLookup(), k=3)
    engine = decoder.engine(max_batch=8)
    rids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    bad = engine.add_request([97, 98, POISON, 99, 100], PARAMS)  # ids: the poison verbatim
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    sampled_alone = decoder.generate(PROMPTS[0], seeded).token_ids
    sampled = engine.add_request(PROMPTS[0], seeded)
    ids, texts, errors = run_events(engine)
    assert set(errors) == {bad} and "poisoned" in str(errors[bad])
    assert [ids[r] for r in rids] == [o.token_ids for o in solo]  # greedy: token for token
    assert ["".join(texts[r]) for r in rids] == [o.text for o in solo]  # streamed text too
    assert ids[sampled] == sampled_alone  # a sampled row keeps its draws
    with pytest.raises(RuntimeError, match="poisoned"):  # run() raises the row's error
        decoder.generate([[97, 98, 99], [97, POISON, 98]], PARAMS)


def test_a_long_prompt_is_fed_in_chunks_and_never_stalls_the_others(text_target, tokenizer):
    chunked = DecodeConfig(prefill_chunk=16, prefill_knee=10**6)
    decoder = SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k=3, config=chunked)
    whole = SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k=3)
    long_prompt = list(range(40, 140)) * 2  # 200 ids: 12 chunks of 16, then its first round
    short = SamplingParams(max_new_tokens=40, ignore_eos=True)
    short_alone = decoder.generate(SHORT, short).token_ids
    long_alone = whole.generate(long_prompt, PARAMS).token_ids
    assert decoder.generate(long_prompt, PARAMS).token_ids == long_alone  # chunks: same tokens
    engine = decoder.engine(max_batch=4)
    first = engine.add_request(SHORT, short)
    ids = {first: []}
    for event in engine.step():  # the short row is decoding when the long prompt arrives
        ids[event.request_id].extend(event.token_ids)
    second = engine.add_request(long_prompt, PARAMS)
    ids[second], stalled, prefill_rounds = [], 0, 0
    while engine.has_work:
        short_running = any(r.request_id == first for r in engine.scheduler.running)
        events = engine.step()
        prefill_rounds += not any(e.request_id == second for e in events)
        stalled += short_running and not any(e.request_id == first for e in events)
        for event in events:
            ids[event.request_id].extend(event.token_ids)
    assert stalled == 0  # a token (or more) for the short row every round
    assert prefill_rounds >= len(long_prompt) // 16 - 1  # the long prompt did come in chunks
    assert ids[first] == short_alone and ids[second] == long_alone


def drafter_with_spy(kind: str, text_target, monkeypatch) -> tuple:
    """(target, runtime, drafter, reads): a draft model or a feature draft for the target,
    and the list every draft pass appends its rows' positions to, one count a row."""
    reads: list[int] = []
    if kind == "draft model":
        draft = perturbed_copy(text_target, 0.02, 0)
        forward = HFRunner._forward

        def spied(runner, new_ids, start, num_logits):
            if runner.model is draft:
                reads.append(int(new_ids.numel()))
            return forward(runner, new_ids, start, num_logits)

        monkeypatch.setattr(HFRunner, "_forward", spied)
        return text_target, "auto", ModelDrafter(make_runner(draft), EOS_ID + 1), reads
    target = tiny_llama(EOS_ID + 1, seed=0, dtype=torch.float32)  # the native runtime's
    step_rows = _FeatureModel.step_rows

    def spied_rows(model, passes, taps=None, trees=None):
        reads.extend(int(ids.numel()) for _, _, ids, _ in passes)
        return step_rows(model, passes, taps, trees)

    monkeypatch.setattr(_FeatureModel, "step_rows", spied_rows)
    return target, "native", feature_drafter(target, EOS_ID + 1), reads


@pytest.mark.parametrize("kind", ["draft model", "feature draft"])
def test_a_long_prompts_drafter_reads_it_a_chunk_a_round(kind, text_target, tokenizer,
                                                         monkeypatch):
    """The drafters of long prompts arriving beside a decoding row read them chunk by chunk
    with the target (Drafter.catch_up), not in one pass at their first proposal, which stalled
    every other row's round: no draft pass reads more than a chunk (and the token after it) of
    a row. Outputs stay the solo ones: greedy the target's own, sampled the same draws."""
    target, runtime, drafter, reads = drafter_with_spy(kind, text_target, monkeypatch)
    chunk = 16
    chunked = DecodeConfig(prefill_chunk=chunk, prefill_knee=10**6)  # 16 tokens a round
    decoder = SpeculativeDecoder(target, tokenizer, drafter, k=3, runtime=runtime,
                                 config=chunked)
    plain = SpeculativeDecoder(target, tokenizer, None, runtime=runtime, config=chunked)
    long_prompt = list(range(40, 140)) * 2  # 200 ids: 12 chunks of 16, then its first round
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    short = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # first, on cold caches as in the batch (a prompt already cached lets the first round
    # draft, and a sampled row with another K makes other draws)
    sampled_alone = decoder.generate(long_prompt, sampled).token_ids
    long_alone = plain.generate(long_prompt, PARAMS).token_ids
    assert decoder.generate(long_prompt, PARAMS).token_ids == long_alone  # lossless
    short_alone = decoder.generate(SHORT, short).token_ids
    engine = decoder.engine(max_batch=4)
    first = engine.add_request(SHORT, short)
    ids = {first: engine.step()[0].token_ids}  # decoding when the long prompts arrive
    greedy_long, sampled_long = (engine.add_request(long_prompt, p) for p in (PARAMS, sampled))
    ids |= {greedy_long: [], sampled_long: []}
    reads.clear()
    while engine.has_work:
        for event in engine.step():
            ids[event.request_id].extend(event.token_ids)
    assert max(reads) <= chunk + 1 and sum(reads) >= 2 * len(long_prompt)  # both prompts read
    assert ids[first] == short_alone and ids[greedy_long] == long_alone
    assert ids[sampled_long] == sampled_alone


def test_the_first_token_waits_for_no_draft_model_reading_the_prompt(text_target, tokenizer,
                                                                     monkeypatch):
    """A prompt of one chunk: its first round is the prompt pass alone (a draft model that has
    not read the prompt sits it out: FIRST_ROUND_READ), and the draft drafts from the next
    round on; the output is the target's."""
    target, runtime, drafter, reads = drafter_with_spy("draft model", text_target, monkeypatch)
    decoder = SpeculativeDecoder(target, tokenizer, drafter, k=3, runtime=runtime)
    plain = SpeculativeDecoder(target, tokenizer, None, runtime=runtime)
    prompt = list(range(40, 100))  # 60 ids, past FIRST_ROUND_READ
    engine = decoder.engine(max_batch=2)
    engine.add_request(prompt, PARAMS)
    first = engine.step()
    assert [len(event.token_ids) for event in first] == [1]
    assert sum(reads) == 0
    while engine.has_work:
        for event in engine.step():
            if event.output is not None:
                output = event.output
    assert sum(reads) >= len(prompt) and output.stats.drafted > 0
    assert output.token_ids == plain.generate(prompt, PARAMS).token_ids


def test_chunk_size_is_validated():
    with pytest.raises(ValueError, match="prefill_chunk"):
        DecodeConfig(prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill_knee"):
        DecodeConfig(prefill_knee=0)
    config = DecodeConfig(prefill_chunk=256, prefill_knee=1024)
    assert [config.chunk_at(fed) for fed in (0, 1024, 5120, 10**6)] == [256, 128, 42, 16]
    with pytest.raises(ValueError, match="cost_batch_sizes"):
        DecodeConfig(cost_batch_sizes=(2, 4))
    assert DecodeConfig().as_dict()["tree_max_batch"] == 1


def test_a_draft_asked_for_no_tokens_is_not_run(text_target, tokenizer):
    """At K = 0 (a draft priced out) the draft model makes no pass at all; its cache catches
    up when it is next asked for tokens."""
    from verispec.costs import CostModel
    from verispec.runtime import make_runner

    draft = ModelDrafter(make_runner(perturbed_copy(text_target, 0.02, 0)), EOS_ID + 1)
    dear = CostModel(draft_step=2.0, verify=(1.0,) + (3.0,) * 8, target_step_s=0.01)
    decoder = SpeculativeDecoder(text_target, tokenizer, draft, k="auto", costs=dear)
    out = decoder.generate(PROMPTS[0], PARAMS)
    assert draft.runner.forward_calls == 0 and out.stats.drafted == 0  # K = 0 every round
    decoder = SpeculativeDecoder(text_target, tokenizer, draft, k=2)
    assert decoder.generate(PROMPTS[0], PARAMS).stats.drafted > 0
    assert draft.runner.forward_calls > 0  # the same draft runs when it is asked for tokens


def test_decode_config_travels_with_the_decoder(text_target, tokenizer):
    config = dataclasses.replace(DecodeConfig(), auto_k_max=4, heuristic_start_k=2)
    decoder = SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k="heuristic",
                                 config=config)
    engine = decoder.engine(max_batch=1)
    engine.add_request(PROMPTS[0], PARAMS)
    assert engine.scheduler.waiting[0].policy.next_k(None) == 2
