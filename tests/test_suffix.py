"""Suffix lookup across requests: the automaton against its definition, the cache's bound and
eviction, scopes, the drafter beside prompt lookup, and the engine with it (exact law with a
negative control, greedy equality, reuse of an earlier request's output)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    always_accept_rows,
    chi2_pvalue,
    exact_joint,
    first_two_counts,
    tiny_llama,
)

from verispec import SamplingParams, SpeculativeDecoder
from verispec.config import EngineConfig
from verispec.drafters import SuffixDrafter
from verispec.drafters.load import load_drafter, resolve_draft
from verispec.drafters.suffix_cache import SuffixAutomaton, SuffixCache

PARAMS = SamplingParams()


# -- the automaton and the cache ------------------------------------------------------------

def occurrences(documents: list[list[int]], pattern: list[int]) -> list[int]:
    """By brute force: the token after each occurrence of pattern in the documents (None at a
    document's end)."""
    after = []
    for doc in documents:
        for start in range(len(doc) - len(pattern) + 1):
            if doc[start:start + len(pattern)] == pattern:
                end = start + len(pattern)
                after.append(doc[end] if end < len(doc) else None)
    return after


def test_automaton_matches_and_counts_agree_with_brute_force():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = 2 + trial % 4
        documents = [torch.randint(0, vocab, (1 + (trial * 7 + d) % 25,),
                                   generator=generator).tolist() for d in range(1 + trial % 4)]
        automaton = SuffixAutomaton()
        for i, doc in enumerate(documents):
            automaton.add_document(i, doc)
        assert automaton.states <= 2 * (sum(map(len, documents)) + len(documents)) + 1
        context = torch.randint(0, vocab, (1 + trial % 12,), generator=generator).tolist()
        state, n = automaton.match(context)
        # the longest suffix of the context that occurs followed by a token
        expected = next((m for m in range(len(context), 0, -1)
                         if any(t is not None for t in occurrences(documents, context[-m:]))), 0)
        assert n == expected
        if n:
            after = occurrences(documents, context[-n:])
            assert automaton.count[state] == len(after)
            token, child = automaton.best_child(state)
            followers = [t for t in after if t is not None]
            assert automaton.count[child] == followers.count(token) == max(
                followers.count(t) for t in set(followers))


def test_cache_docstring_example():
    cache = SuffixCache()
    for doc in ([1, 2, 3], [1, 2, 4], [1, 2, 3]):
        cache.add("", doc)
    proposal = cache.propose("", [9, 1, 2], 1)
    assert (proposal.tokens, proposal.matched) == ([3], 2)
    assert proposal.probabilities == [pytest.approx(2 / 3)]
    assert cache.propose("", [9, 1, 2], 1, min_probability=0.7).tokens == []


def test_cache_stays_within_its_token_budget_and_evicts_least_recently_used():
    cache = SuffixCache(max_tokens=100)
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 1000, (30,), generator=generator).tolist() for _ in range(12)]
    cache.add("a", docs[0])
    for i, doc in enumerate(docs[1:], 1):
        assert cache.propose("a", docs[0][:10], 3).tokens == docs[0][10:13]  # keeps it used
        cache.add("a" if i % 2 else "b", doc)
        usage = cache.usage()
        assert usage.tokens <= 100
        assert usage.states <= 2 * (usage.tokens + usage.documents) + 1
    usage = cache.usage()
    assert usage.evicted >= 8
    assert cache.propose("a", docs[0][:10], 3).tokens == docs[0][10:13]  # used: kept
    assert cache.propose("a", docs[1][:10], 3).tokens == []  # unused and old: evicted
    assert cache.propose("a", docs[-1][:10], 3).tokens == docs[-1][10:13]  # newest: kept
    cache.add("a", list(range(500)))  # longer than the budget: its last 100 tokens
    assert cache.usage().tokens <= 100


def test_scopes_keep_text_apart_and_none_keeps_nothing():
    cache = SuffixCache()
    cache.add("a", [5, 6, 7, 8])
    cache.add(None, [1, 2, 3, 4])
    assert cache.propose("a", [5, 6], 2).tokens == [7, 8]
    assert cache.propose("b", [5, 6], 2).tokens == []
    assert cache.propose(None, [5, 6], 2).tokens == []
    assert cache.usage().tokens == 4


# -- the drafter ----------------------------------------------------------------------------

def scoped(scope: str | None) -> SamplingParams:
    return SamplingParams(lookup_scope=scope)


def test_drafter_docstring_example_and_forks_share_the_cache():
    drafter = SuffixDrafter()
    drafter.fork().retire(torch.tensor([5, 6, 7, 8]), scoped("a"))
    draft = drafter.fork().propose(torch.tensor([1, 5, 6]), 2, scoped("a"), None)
    assert (draft.tokens.tolist(), draft.source, draft.probs) == ([7, 8], 2, None)
    assert len(drafter.propose(torch.tensor([1, 5, 6]), 2, scoped("b"), None)) == 0
    assert len(drafter.propose(torch.tensor([1, 5, 6]), 2, scoped(None), None)) == 0


def test_drafter_is_prompt_lookup_without_a_cache_and_the_longer_match_wins():
    drafter = SuffixDrafter(max_match=5)
    history = torch.tensor([5, 1, 2, 8, 4, 2, 7, 5, 1, 2])
    draft = drafter.propose(history, 2, PARAMS, None)
    assert (draft.tokens.tolist(), draft.source) == ([8, 4], 3)  # as NgramDrafter
    drafter.retire(torch.tensor([7, 5, 1, 2, 9, 9]), PARAMS)  # a 4-token match beats 3
    draft = drafter.propose(history, 2, PARAMS, None)
    assert (draft.tokens.tolist(), draft.source) == ([9, 9], 4)
    long = torch.arange(20)
    drafter.retire(torch.cat([long, torch.tensor([42])]), PARAMS)
    assert drafter.propose(long, 1, PARAMS, None).source == 5  # capped at max_match


def test_suffix_is_a_draft_spec():
    assert resolve_draft("suffix") == "suffix"
    assert isinstance(load_drafter("suffix", None, None), SuffixDrafter)


# -- the engine with it ---------------------------------------------------------------------

V = 8
PROMPT = [1, 2, 3, 1, 2]
N = 3000
N_CONTROL = 1000  # the broken engine is far off: fewer runs already reject it


@pytest.fixture(scope="module")
def target():
    return tiny_llama(V, seed=3, init=0.5)


def test_engine_with_suffix_lookup_matches_target_joint(target):
    """Every run's text enters the cache, so later runs draft the most frequent earlier
    continuation: the law of the first two tokens is still the target's."""
    params = SamplingParams(temperature=1.0)
    decoder = SpeculativeDecoder(target, None, SuffixDrafter(), k=3)
    counts = first_two_counts(decoder, PROMPT, V, params, N)
    assert decoder.drafter.cache.usage().documents > 0
    assert chi2_pvalue(counts, exact_joint(target, PROMPT, params)) > 1e-3


def test_negative_control_always_accept_with_suffix_lookup_is_detected(target, monkeypatch):
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    decoder = SpeculativeDecoder(target, None, SuffixDrafter(), k=3)
    counts = first_two_counts(decoder, PROMPT, V, params, N_CONTROL)
    assert chi2_pvalue(counts, exact_joint(target, PROMPT, params)) < 1e-6


@pytest.mark.parametrize("k", [1, 4, 8])
def test_speculative_greedy_with_suffix_lookup_equals_plain_greedy(text_target, tokenizer, k):
    plain = SpeculativeDecoder(text_target, tokenizer, drafter=None)
    spec = SpeculativeDecoder(text_target, tokenizer, SuffixDrafter(), k=k)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for prompt in ["hello world, hello world, hello", "abcabcabc", "The quick brown fox"] * 2:
        expected = plain.generate(prompt, params)  # (the second time, from a full cache)
        got = spec.generate(prompt, params)
        assert got.token_ids == expected.token_ids
        assert got.text == expected.text


def test_a_request_repeating_an_earlier_output_gets_long_proposals(text_target, tokenizer):
    spec = SpeculativeDecoder(text_target, tokenizer, SuffixDrafter(), k=8)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    first = spec.generate("The quick brown fox", params)
    again = spec.generate("The quick brown fox", params)
    assert again.token_ids == first.token_ids
    assert again.stats.tokens_per_forward > 6 > first.stats.tokens_per_forward
    other_scope = spec.generate("The quick brown fox", SamplingParams(
        max_new_tokens=64, ignore_eos=True, lookup_scope="elsewhere"))
    assert other_scope.stats.tokens_per_forward == pytest.approx(
        first.stats.tokens_per_forward)


# -- the CLI and the bench ------------------------------------------------------------------

def test_cli_generate_with_suffix_lookup_equals_plain(capsys, model_folders):
    import json

    from verispec.cli import main

    common = ["generate", "abcabcabc", "--target", str(model_folders / "target"),
              "--temperature", "0", "--max-new-tokens", "24", "--ignore-eos", "--json"]
    outputs = []
    for draft in ("suffix", "none"):
        assert main([*common, "--draft", draft]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24
    with pytest.raises(SystemExit):
        main(["serve", "--suffix-cache", "global"])


def test_bench_runs_the_suffix_method(model_folders, tmp_path):
    from verispec.bench.bench_config import BenchConfig
    from verispec.bench.harness import run_bench

    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"), draft=None),
                         methods=("baseline", "ngram", "suffix"), ks=(4,), per_category=1, limit=3,
                         max_new_tokens=12, out=tmp_path / "out")
    results = run_bench(config, progress=False)
    suffix = results["methods"]["suffix"]
    assert suffix["greedy_equal_to_baseline"] == "3/3"
    assert suffix["overall"]["new_tokens"] == 3 * 12


def test_a_seeded_sampled_row_is_not_proposed_other_requests_text():
    """A seeded sampled row's draws depend on its drafts: the same seed must give the same
    output whatever requests came before, so only its own text is looked up; greedy and
    unseeded rows get the cache's proposals."""
    drafter = SuffixDrafter()
    drafter.retire(torch.tensor([5, 6, 7, 8]), SamplingParams())
    history = torch.tensor([1, 5, 6])
    assert drafter.propose(history, 2, SamplingParams(), None).tokens.tolist() == [7, 8]
    unseeded = SamplingParams(temperature=0.8)
    assert drafter.propose(history, 2, unseeded, None).tokens.tolist() == [7, 8]
    seeded = SamplingParams(temperature=0.8, seed=3)
    assert len(drafter.propose(history, 2, seeded, None)) == 0
