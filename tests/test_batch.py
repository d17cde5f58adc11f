"""Batched speculative decoding: each row of a batch decodes as it would alone.

On the native runtime a row's logits are the same bits in any batch, so greedy rows equal their
solo outputs token for token, and a sampled row's law is the target's (a chi-square test of the
first two tokens of rows inside mixed batches, with an always-accept negative control).
"""

from __future__ import annotations

import pytest
import torch
from conftest import always_accept_rows, chi2_pvalue, perturbed_copy, tiny_gpt2, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.costs import CostModel
from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from verispec.drafters.batch_drafting import propose_batch
from verispec.drafters.drafter import ChainCut
from verispec.drafters.model import propose_together
from verispec.runtime import make_runner
from verispec.runtime.native import NativeLlama, NativeRunner
from verispec.runtime.native.llama import RowPass
from verispec.sampling import warp

PROMPTS = ["abcabcabc", "hello world, hello", "the quick brown fox jumps", "zz",
           "one two one two one two three"]


@pytest.fixture(scope="module")
def text_pair(tokenizer):
    target = tiny_llama(len(tokenizer), seed=11, dtype=torch.float32)
    return target, perturbed_copy(target, noise=0.05, seed=1)


def decoder_for(kind: str, target, draft, tokenizer, k=3) -> SpeculativeDecoder:
    model_drafter = ModelDrafter(make_runner(draft, "native"), len(tokenizer))
    drafter = {"ngram": NgramDrafter(), "none": None, "draft": model_drafter,
               "hybrid": HybridDrafter(model_drafter, min_match=2)}[kind]
    return SpeculativeDecoder(target, tokenizer, drafter, k=k, runtime="native")


def test_a_rows_logits_do_not_depend_on_the_batch():
    model = NativeLlama.from_hf(tiny_llama(64, seed=0, dtype=torch.float32), torch.bfloat16)
    ids = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(0))
    caches = [model.new_cache() for _ in range(3)]
    for cache, row in zip(caches, ids, strict=True):
        model.forward(row[:30], 0, 1, cache)
    alone = model.forward(ids[1, 30:34], 30, 4, caches[1])
    together = model.forward_rows([RowPass(caches[0], ids[0, 30:31], 30, 1),
                                   RowPass(caches[1], ids[1, 30:34], 30, 4),
                                   RowPass(caches[2], ids[2, 30:39], 30, 2)])
    assert torch.equal(together[1], alone)
    assert [t.shape[0] for t in together] == [1, 4, 2]


@pytest.mark.parametrize("kind", ["draft", "ngram", "hybrid", "none"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_rows_equal_their_solo_outputs(kind, k, text_pair, tokenizer):
    decoder = decoder_for(kind, *text_pair, tokenizer, k=k)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 12, 25, 40)]
    params.append(SamplingParams(max_new_tokens=40, stop=("o",)))  # a stop string mid-way
    alone = [decoder.generate(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    together = decoder.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    assert [len(o.token_ids) for o in together[:4]] == [30, 12, 25, 40]
    if kind != "none" and k == 3:  # (auto may rightly find a draft as big as this target
        assert sum(o.stats.accepted for o in together) > 0  # too dear, and not draft at all)


class _CountingDrafter(NgramDrafter):
    """A stand-in for a draft model that records the K it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def propose(self, history, k, params, generator):
        self.asked.append(k)
        return super().propose(history, k, params, generator)


def test_a_hybrid_lookup_proposes_up_to_the_free_k_and_the_model_its_own():
    history = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7])  # [5, 6, 7] recurs
    fresh = torch.tensor([1, 2, 3, 4])  # nothing recurs
    model = _CountingDrafter()
    rows = [HybridDrafter(model, min_match=3), HybridDrafter(model, min_match=3)]
    drafts = propose_batch(rows, [history, fresh], [1, 1], [SamplingParams()] * 2, [None] * 2,
                           free_ks=[4, 4])
    assert drafts[0].tokens.tolist() == [8, 9, 10, 11] and drafts[0].source == 3
    assert model.asked == [1]  # only the row without a match asked the model, for its own K
    drafts = propose_batch(rows, [history, fresh], [0, 0], [SamplingParams()] * 2, [None] * 2,
                           free_ks=[2, 2])
    assert drafts[0].tokens.tolist() == [8, 9] and not len(drafts[1])
    assert model.asked == [1]  # K = 0 for the model: it is not asked at all


def test_rows_finish_on_eos_without_stalling_others(text_pair, tokenizer):
    decoder = decoder_for("ngram", *text_pair, tokenizer, k=4)
    params = SamplingParams(max_new_tokens=30)
    # Declare as EOS the most common token of the solo outputs: rows then end at different
    # rounds (or run to their budget), and later rows join as earlier ones leave.
    solo = [decoder.generate(p, SamplingParams(max_new_tokens=30, ignore_eos=True)).token_ids
            for p in PROMPTS]
    decoder.eos_ids = frozenset({max(range(len(tokenizer)),
                                     key=lambda t: sum(t in ids for ids in solo))})
    alone = [decoder.generate(p, params) for p in PROMPTS]
    assert len({len(o.token_ids) for o in alone}) >= 3
    assert "stop" in {o.finish_reason for o in alone}
    together = decoder.generate(PROMPTS, params, max_batch=3)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in together] == [o.finish_reason for o in alone]


def test_sampled_rows_equal_their_solo_outputs_for_the_same_seed(text_pair, tokenizer):
    decoder = decoder_for("draft", *text_pair, tokenizer)
    params = [SamplingParams(max_new_tokens=20, temperature=t, top_k=tk, seed=s, ignore_eos=True)
              for t, tk, s in ((1.0, 0, 1), (0.7, 10, 2), (0.0, 0, 3), (1.3, 0, 4), (1.0, 5, 5))]
    alone = [decoder.generate(p, sp).token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    assert [o.token_ids for o in decoder.generate(PROMPTS, params)] == alone


def test_cancel_and_join_mid_flight_leave_other_rows_unchanged(text_pair, tokenizer):
    decoder = decoder_for("draft", *text_pair, tokenizer)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = {p: decoder.generate(p, params).token_ids for p in PROMPTS}
    engine = decoder.engine(max_batch=4)
    ids = {engine.add_request(p, params): p for p in PROMPTS[:3]}
    texts: dict[int, list[int]] = {i: [] for i in ids}
    outputs = {}
    for step in range(100):
        if step == 2:
            cancelled = next(iter(ids))
            assert engine.cancel(cancelled) and not engine.cancel(cancelled)
        if step == 3:
            for p in PROMPTS[3:]:
                rid = engine.add_request(p, params)
                ids[rid], texts[rid] = p, []
        for event in engine.step():
            texts[event.request_id].extend(event.token_ids)
            if event.output is not None:
                outputs[event.request_id] = event.output
        if not engine.has_work:
            break
    assert cancelled not in outputs and set(outputs) == set(ids) - {cancelled}
    for rid, output in outputs.items():
        assert output.token_ids == expected[ids[rid]] == texts[rid]  # streamed pieces add up


def test_the_hf_runtime_batches_row_by_row(tokenizer):
    model = tiny_gpt2(len(tokenizer), seed=0, dtype=torch.float32)
    decoder = SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    together = decoder.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in together] == [decoder.generate(p, params).token_ids
                                               for p in PROMPTS[:3]]


def test_batch_arguments_are_checked(text_pair, tokenizer):
    decoder = decoder_for("ngram", *text_pair, tokenizer)
    with pytest.raises(ValueError, match="2 prompts but 3 params"):
        decoder.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="list of prompts"):
        decoder.generate("a", [SamplingParams()])
    with pytest.raises(ValueError, match="empty"):
        decoder.generate(["a", ""])
    with pytest.raises(ValueError, match="max_batch"):
        decoder.engine(max_batch=0)


# -- the law of a sampled row inside mixed batches ---------------------------------------------

V = 8
PROMPT = [1, 2, 3, 1, 2]
ROWS_PER_BATCH, BATCHES = 30, 100  # 3,000 samples of the measured request
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(V, seed=3, init=0.5, dtype=torch.float32)
    return target, perturbed_copy(target, noise=0.2, seed=0)


def native_joint(model) -> torch.Tensor:
    """p(t1, t2) [V, V] of the native bf16 runtime itself (the probabilities the engine uses)."""
    runner = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    first = warp(runner.logits(torch.tensor(PROMPT), 1)[0], PARAMS)  # [V]
    second = torch.stack([warp(runner.logits(torch.tensor(PROMPT + [t]), 1)[0], PARAMS)
                          for t in range(V)])  # [V, V]
    return (first.unsqueeze(1) * second).double()


def batched_counts(target, draft, k: int | str = 3) -> torch.Tensor:
    """First two tokens of the measured request, ROWS_PER_BATCH copies (own seeds) per batch,
    mixed with greedy, top-k and longer requests on other prompts. k="auto" runs on fixed
    prices where drafting pays and each row's chain is cut at the batch's prices
    (`RoundPlanner._allocate`), by acceptance estimates that change from round to round."""
    prices = CostModel(0.0, (1.0, 1.25, 1.35, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1), 1e-3)
    decoder = SpeculativeDecoder(target, None, ModelDrafter(make_runner(draft, "native"), V),
                                 k=k, runtime="native", costs=prices)
    if k == "auto":
        decoder.cost_table.prices = lambda batch: prices
    counts = torch.zeros(V, V, dtype=torch.float64)
    others = [([4, 5, 6], SamplingParams(max_new_tokens=6, ignore_eos=True)),
              ([7, 7, 1, 2], SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3, seed=9,
                                            ignore_eos=True))]
    for batch in range(BATCHES):
        prompts, params = [], []
        for row in range(ROWS_PER_BATCH):
            prompts.append(PROMPT)
            params.append(SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True,
                                         seed=batch * ROWS_PER_BATCH + row))
        outputs = decoder.generate([p for p, _ in others] + prompts,
                                   [sp for _, sp in others] + params)
        for output in outputs[len(others):]:
            first, second = output.token_ids
            counts[first, second] += 1
    return counts


@pytest.mark.parametrize("k", [3, "auto"])
def test_a_sampled_row_in_a_mixed_batch_has_the_targets_law(small_pair, k):
    target, draft = small_pair
    assert chi2_pvalue(batched_counts(target, draft, k), native_joint(target)) > 1e-3


def test_negative_control_always_accept_in_a_batch_is_detected(small_pair, monkeypatch):
    target, draft = small_pair
    joint = native_joint(target)
    assert 0.5 * (joint - native_joint(draft)).abs().sum() > 0.1
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    assert chi2_pvalue(batched_counts(target, draft), joint) < 1e-6
    assert chi2_pvalue(batched_counts(target, draft, "auto"), joint) < 1e-6  # drafts are verified


def test_batch_costs_time_drafting_the_way_the_scheduler_drafts(text_pair, tokenizer,
                                                                 monkeypatch):
    """A batch's draft step c is timed with the proposals the scheduler makes at that size:
    chains where greedy rows do not draft trees (a tree's first step costs more)."""
    import verispec.costs as costs_module

    asked = []
    real = costs_module.propose_batch

    def spy(*args, greedy_trees=True, **kwargs):
        asked.append(greedy_trees)
        return real(*args, greedy_trees=greedy_trees, **kwargs)

    monkeypatch.setattr(costs_module, "propose_batch", spy)
    decoder = decoder_for("hybrid", *text_pair, tokenizer, k="auto")
    for size in (2, 4):
        asked.clear()
        decoder.cost_table.measure(size)
        assert asked and set(asked) == {size <= decoder.config.tree_max_batch}


def test_a_batch_verifies_only_the_lookup_tokens_that_pay_for_every_row(text_pair, tokenizer,
                                                                      monkeypatch):
    """Under K "auto", a batch's chains are cut at the batch's prices (theory.batch_allocation):
    where an extra position costs a whole step no lookup token is verified; where it is free,
    lookups are verified; the outputs are the solo ones either way."""
    decoder = decoder_for("ngram", *text_pair, tokenizer, k="auto")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    alone = [decoder.generate(p, params).token_ids for p in PROMPTS]
    checked = {}
    for name, slope in (("dear", 1.0), ("free", 0.0)):
        verify = tuple(1.0 + slope * n for n in range(9))
        monkeypatch.setattr(decoder.cost_table, "prices",
                            lambda batch, v=verify: CostModel(0.0, v, 1e-3))
        together = decoder.generate(PROMPTS, params)
        assert [o.token_ids for o in together] == alone
        checked[name] = sum(o.stats.checked for o in together)
    assert checked["dear"] == 0 < checked["free"]


def test_a_draft_chain_stops_where_the_drafters_confidence_no_longer_pays(text_pair):
    """ChainCut: at free verification a cut chain is the uncut one; where each position is
    dear, a chain the drafter is unsure of is cut to a prefix of it; the cut's rule on its
    docstring's example."""
    cut = ChainCut(0.1, (1.0, 1.1, 1.2))
    assert cut.keeps([0.9]) and not cut.keeps([0.9, 0.045])
    _, draft = text_pair
    history = torch.tensor([5, 6, 7, 8])
    greedy = [SamplingParams(temperature=0.0)]

    def chain(row_cut):
        drafter = ModelDrafter(draft, draft.config.vocab_size)
        return propose_together([drafter], [history], [4], greedy, [None],
                                cuts=[row_cut])[0].tokens.tolist()

    uncut = chain(None)
    assert len(uncut) == 4
    assert chain(ChainCut(0.0, (1.0,) * 6)) == uncut
    dear = chain(ChainCut(0.05, (1.0, 1.2, 1.4, 1.6, 1.8)))
    assert dear == uncut[:len(dear)] and len(dear) < len(uncut)
