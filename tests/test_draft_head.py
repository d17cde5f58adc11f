"""A draft model at a fraction of the target's cost: the trimmed head (FR-Spec) and re-quantised
draft weights. Both change what the draft proposes, never what is emitted: the head ids' rank
order, q a proper distribution over the subset (zero outside), greedy speculative output equal
to plain greedy (also when the target's argmax lies outside the subset), the target's law with a
trimmed draft (beside an always-accept negative control), and the re-quantised cache (valid
drafts, rebuilt when the source changes)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import (
    always_accept_rows,
    chi2_pvalue,
    exact_joint,
    first_two_counts,
    perturbed_copy,
    tiny_llama,
)
from gguf import GGMLQuantizationType
from test_gguf import VOCAB, write_tiny_gguf

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import ModelDrafter
from verispec.drafters import load as load_module
from verispec.drafters.vocab_rank import head_ids, save_ranking, trim_head
from verispec.quant import requant
from verispec.quant.gguf import read
from verispec.quant.quantized_model import GGUFModel
from verispec.runtime import make_runner

Q = GGMLQuantizationType
PROMPT = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 4, 8]


def test_head_ids_keep_specials_then_the_ranking_then_id_order():
    ranking = torch.tensor([5, 9, 40])  # 40 lies outside a vocabulary of 12: dropped
    assert head_ids(ranking, 12, 4, always=[11]).tolist() == [11, 5, 9, 0, 1, 2, 3, 4, 6, 7, 8,
                                                              10]  # 16 rows, capped at 12
    assert head_ids(ranking, 40, 4, always=[11]).tolist() == [11, 5, 9, 0, 1, 2, 3, 4, 6, 7,
                                                              8, 10, 12, 13, 14, 15]
    assert head_ids(ranking, 40, 17, always=[11]).numel() == 32  # a multiple of 16
    assert head_ids(ranking, 40, 17).unique().numel() == 32  # no id twice


def test_a_ranking_file_reads_back(tmp_path):
    path = tmp_path / "ranking.npz"
    save_ranking(path, {7: 3, 2: 5, 9: 3}, {"prompts": 1})
    import numpy as np

    with np.load(path) as data:
        assert data["ids"].tolist() == [2, 7, 9]  # by count, ties by id
        assert data["counts"].tolist() == [5, 3, 3]
    # the target's probabilities rank tokens it came close to writing; 0 and 1 score too little
    mass = torch.tensor([0.0, 1e-4, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    save_ranking(path, {7: 3, 2: 5, 9: 3}, {}, mass)
    with np.load(path) as data:
        assert data["ids"].tolist() == [2, 9, 7, 3]  # 5.5, 5.0, 3.0, 0.2
        assert data["counts"].tolist() == [5, 3, 3, 0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft-head")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    write_tiny_gguf(target)
    write_tiny_gguf(draft, seed=1)
    return target, draft


@pytest.fixture(autouse=True)
def private_requant_cache(tmp_path, monkeypatch):
    """Re-quantised drafts go to this test's folder, never ~/.cache."""
    monkeypatch.setattr(requant, "cache_root", lambda: tmp_path / "models")


def trimmed_drafter(path, ids: torch.Tensor) -> ModelDrafter:
    model = GGUFModel(read(path))
    trim_head(model, ids)
    return ModelDrafter(make_runner(model), VOCAB, head_token_ids=ids)


def plain_greedy(target) -> list[int]:
    decoder = SpeculativeDecoder.from_pretrained(target, draft=None, dequantize=None)
    return decoder.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids


def test_trimmed_head_reads_only_the_subset_rows(files):
    ids = torch.arange(0, 64, 2)  # 32 rows
    full, model = GGUFModel(read(files[1])), GGUFModel(read(files[1]))
    trim_head(model, ids)
    assert tuple(model.head.shape) == (32, full.head.shape[1])
    assert torch.equal(model.head.dequantize(), full.head.dequantize()[ids])
    runner = make_runner(model)
    assert runner.vocab_size == 32
    assert torch.equal(runner.logits(torch.tensor(PROMPT), 1)[0],
                       make_runner(full).logits(torch.tensor(PROMPT), 1)[0][ids])


def test_sampled_proposals_are_a_distribution_over_the_subset(files):
    ids = torch.arange(16, 48)
    drafter = trimmed_drafter(files[1], ids)
    params = SamplingParams(temperature=1.0, seed=0)
    draft = drafter.propose(torch.tensor(PROMPT), 4, params, torch.Generator().manual_seed(0))
    assert draft.probs.shape == (4, VOCAB)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4, dtype=draft.probs.dtype))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert draft.probs[:, outside].abs().max() == 0
    assert (draft.probs[:, ids] > 0).all()
    assert all(16 <= t < 48 for t in draft.tokens.tolist())


@pytest.mark.parametrize("subset", ["the target's tokens kept", "the target's tokens cut"])
def test_speculative_greedy_equals_plain_greedy_with_a_trimmed_head(files, subset):
    target, draft = files
    expected = plain_greedy(target)
    written = sorted(set(expected))
    if subset == "the target's tokens kept":
        ids = head_ids(torch.tensor(written), VOCAB, 32)
    else:  # the draft can propose none of them: every emitted token comes from the target
        ids = torch.tensor([t for t in range(VOCAB) if t not in written][:32])
        assert not set(expected) & set(ids.tolist())
    decoder = SpeculativeDecoder(GGUFModel(read(target)), None, trimmed_drafter(draft, ids), k=4)
    output = decoder.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert output.token_ids == expected
    assert output.stats.checked > 0
    if subset == "the target's tokens cut":
        assert output.stats.accepted == 0


def test_load_drafter_trims_with_the_shipped_ranking(files, monkeypatch):
    target, draft = files
    ranking = torch.arange(VOCAB - 1, -1, -1)  # reversed ids
    monkeypatch.setattr(load_module, "load_ranking", lambda tokenizer: ranking)
    model = GGUFModel(read(target))
    drafter = load_module.load_drafter(str(draft), model, object(), dequantize=None,
                                       draft_vocab=20, draft_quant=None)
    assert drafter.head_token_ids.tolist() == list(range(VOCAB - 1, VOCAB - 33, -1))
    assert drafter.runner.vocab_size == 32
    full = load_module.load_drafter(str(draft), model, object(), dequantize=None,
                                    draft_vocab=0, draft_quant=None)
    assert full.head_token_ids is None and full.runner.vocab_size == VOCAB


# The law: a tiny HF target over 8 tokens, a noisy copy whose head keeps 4 of them.
V, LAW_PROMPT, N = 8, [1, 2, 3, 1, 2], 3000
SUBSET = torch.tensor([0, 3, 4, 6])  # not 5, the target's likelier first token


@pytest.fixture(scope="module")
def law_pair():
    target = tiny_llama(V, seed=3, init=0.5)
    draft = perturbed_copy(target, noise=0.2, seed=0)
    trim_head(draft, SUBSET)
    return target, draft


def test_trimmed_draft_engine_matches_the_target_joint(law_pair):
    target, draft = law_pair
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(target, LAW_PROMPT, params)
    # the target writes tokens the draft cannot propose
    assert 1 - joint[SUBSET][:, SUBSET].sum() > 0.5
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V, SUBSET), k=3)
    counts = first_two_counts(decoder, LAW_PROMPT, V, params, N)
    assert chi2_pvalue(counts, joint) > 1e-3


def test_negative_control_always_accept_with_a_trimmed_draft_is_detected(law_pair,
                                                                          monkeypatch):
    target, draft = law_pair
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    decoder = SpeculativeDecoder(target, None, ModelDrafter(draft, V, SUBSET), k=3)
    counts = first_two_counts(decoder, LAW_PROMPT, V, params, N)
    assert chi2_pvalue(counts, exact_joint(target, LAW_PROMPT, params)) < 1e-6


def test_requantised_weights_load_and_draft_exactly(files, tmp_path):
    target, draft = files
    source = read(draft)
    cheaper = requant.requantized(source, Q.Q4_0)
    converted = requant.chosen(source, Q.Q4_0)
    # wider than Q4_0's 4.5 bits: Q8_0, Q5_0, Q5_1, Q4_1 layers; the head is Q4_0 already
    assert converted and "output.weight" not in converted
    assert "token_embd.weight" not in converted  # not tied: one row a step
    assert all(cheaper.tensors[name].qtype == Q.Q4_0 for name in converted)
    model = GGUFModel(cheaper)
    assert "Q4_0" in model.describe()
    drafter = ModelDrafter(make_runner(model), VOCAB)
    decoder = SpeculativeDecoder(GGUFModel(read(target)), None, drafter, k=4)
    output = decoder.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert output.token_ids == plain_greedy(target)


def test_the_requantised_cache_is_reused_and_rebuilt_when_the_source_changes(files, tmp_path,
                                                                             monkeypatch):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(files[1].read_bytes())
    conversions = []
    convert = requant._convert
    monkeypatch.setattr(requant, "_convert", lambda *args: conversions.append(args[-1]) or
                        convert(*args))
    first = requant.requantized(read(draft), Q.Q4_0)
    again = requant.requantized(read(draft), Q.Q4_0)
    assert len(conversions) == 1
    name = requant.chosen(read(draft), Q.Q4_0)[0]
    assert torch.equal(first.tensors[name].data, again.tensors[name].data)
    # a new file in its place (other weights, same name): a new key, a new conversion
    write_tiny_gguf(draft, seed=2)
    os.utime(draft, ns=(draft.stat().st_atime_ns, draft.stat().st_mtime_ns + 10**9))
    changed = requant.requantized(read(draft), Q.Q4_0)
    assert len(conversions) == 2 and conversions[0] != conversions[1]
    assert not torch.equal(changed.tensors[name].data, first.tensors[name].data)
