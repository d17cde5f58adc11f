"""Greedy speculative output is token-identical to plain greedy decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import EOS_ID, perturbed_copy, replay_verification, tiny_gpt2

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import ModelDrafter, NgramDrafter

PROMPTS = ["hello world, hello world, hello", "abcabcabc", "The quick brown fox"]
VOCAB = EOS_ID + 1


def drafters(target):
    return {
        "noisy-copy": ModelDrafter(perturbed_copy(target, noise=0.02, seed=0), VOCAB),
        "gpt2": ModelDrafter(tiny_gpt2(VOCAB, seed=5), VOCAB),
        "ngram": NgramDrafter(),
    }


@pytest.mark.parametrize("name", ["noisy-copy", "gpt2", "ngram"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_speculative_greedy_equals_plain_greedy(text_target, tokenizer, name, k):
    plain = SpeculativeDecoder(text_target, tokenizer, drafter=None)
    spec = SpeculativeDecoder(text_target, tokenizer, drafters(text_target)[name], k=k)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, params)
        got = spec.generate(prompt, params)
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text
        assert got.stats.new_tokens == 60


def test_plain_greedy_equals_transformers_generate(text_target, tokenizer):
    """The baseline itself is checked against an independent oracle: HF generate."""
    plain = SpeculativeDecoder(text_target, tokenizer, drafter=None)
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        reference = text_target.generate(ids, max_new_tokens=40, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
        got = plain.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert got.token_ids == reference[0, ids.shape[1]:].tolist()


def test_draft_that_agrees_is_accepted(text_target, tokenizer):
    spec = SpeculativeDecoder(text_target, tokenizer, drafters(text_target)["noisy-copy"], k=4)
    stats = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=60, ignore_eos=True)).stats
    assert 0.2 < stats.acceptance_rate < 1.0  # both paths exercised
    assert stats.tokens_per_forward > 1.0
    assert stats.checked <= stats.drafted
    assert stats.accepted <= stats.checked
    assert len(stats.per_position_acceptance) <= 4


def test_eos_and_budget_cut_rounds_identically(text_target, tokenizer):
    """Stopping at EOS or max_new_tokens mid-round gives the plain decoder's output."""
    plain = SpeculativeDecoder(text_target, tokenizer, drafter=None)
    spec = SpeculativeDecoder(text_target, tokenizer, drafters(text_target)["noisy-copy"], k=8)
    for max_new in (1, 2, 7, 33):
        params = SamplingParams(max_new_tokens=max_new)
        for prompt in PROMPTS:
            expected = plain.generate(prompt, params)
            got = spec.generate(prompt, params)
            assert got.token_ids == expected.token_ids
            assert len(got.token_ids) <= max_new
            assert got.finish_reason == expected.finish_reason


def test_sampled_output_is_what_the_reference_verifier_draws(text_target, tokenizer,
                                                             monkeypatch):
    """Sampled (top-p, token-wise verification): each round's tokens are the padded reference's
    on that round's draft and warped target rows from the row's generator as it stood, with
    exactly its draws, and the output is those tokens in order; another decoder on the same
    drafter reproduces it for the seed after serving another seed."""
    replays = replay_verification(monkeypatch)
    noisy_copy = drafters(text_target)["noisy-copy"]
    spec = SpeculativeDecoder(text_target, tokenizer, noisy_copy, k=4)
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=7,
                            verify="token")
    out = spec.generate("abc", params).token_ids
    assert len(replays) > 1 and all(engine == reference and same_draws
                                    for engine, reference, same_draws in replays)
    emitted = [token for engine, _, _ in replays for token in engine]
    assert emitted[:len(out)] == out and len(emitted) - len(out) <= 4
    assert sum(len(engine) - 1 for engine, _, _ in replays) > 0  # drafts were accepted
    other = SpeculativeDecoder(text_target, tokenizer, noisy_copy, k=4)  # its cache as left
    other.generate("abc", dataclasses.replace(params, seed=8))
    assert other.generate("abc", params).token_ids == out
