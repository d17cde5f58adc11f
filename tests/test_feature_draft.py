"""The feature (EAGLE-style) draft: `verispec distill --kind feature` end to end on a tiny target,
then the drafter that reads the target's hidden states: lossless greedy and sampled decoding,
alone and in batches, and a clear refusal where the target's features are not kept."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import (
    EOS_ID,
    always_accept_rows,
    byte_tokenizer,
    chi2_pvalue,
    feature_drafter,
    tiny_llama,
)

from verispec import SamplingParams, SpeculativeDecoder
from verispec.distill import DistillConfig, distill
from verispec.distill.feature_head import FeatureHead, FrozenHead
from verispec.drafters import HybridDrafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.folder import is_feature_draft
from verispec.drafters.load import load_drafter
from verispec.errors import IncompatibleDraftError
from verispec.runtime.native import NativeLlama, NativeRunner
from verispec.runtime.native.shape import LlamaShape
from verispec.sampling import warp
from verispec.verify import drafts as drafts_module

VOCAB = EOS_ID + 1


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("feature") / "target"
    tiny_llama(VOCAB, seed=0, layers=3, dtype=torch.float32).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run(target_folder):
    config = DistillConfig(out=target_folder.parent / "run", target=str(target_folder),
                           kind="feature", num_prompts=24, self_prompts=4, eval_prompts=8,
                           shard_prompts=8, max_new_tokens=24, batch_size=8, head_vocab=160,
                           steps=200, lr=3e-3, tv_weight=0.5, checkpoint_every=100,
                           device="cpu")
    return config, distill(config)


@pytest.fixture(scope="module")
def target(target_folder):
    from verispec import loading

    return loading.load(target_folder)


def test_training_lowers_the_kl_and_reports_agreement(run):
    config, result = run
    lines = (config.out / "train-feature.log").read_text().splitlines()
    kls = [float(re.search(r"^step \d+ kl ([\d.]+)", line).group(1)) for line in lines]
    assert len(kls) == 20  # one line every 10 steps
    assert sum(kls[-3:]) < 0.8 * sum(kls[:3])
    assert "held-out" in lines[-1] and 0 <= result.report.heldout_agreement <= 1
    # The held-out acceptance of a sampled draft token (the TV term trains for it), reported
    # at each checkpoint (the random target's held-out text leaves little to learn, so only
    # its range is checked here; sampled_acceptance itself is checked in test_theory).
    accept = [float(m.group(1)) for m in re.finditer(r"acceptance_t1 ([\d.]+)", "\n".join(lines))]
    assert len(accept) == 2 and all(0 < a <= 1 for a in accept)
    assert "--tv-weight 0.5" in (config.out / "draft" / "README.md").read_text()


def test_the_folder_is_small_and_loads_as_a_feature_drafter(run, target):
    _, result = run
    model, tokenizer = target
    assert is_feature_draft(result.draft)
    meta = json.loads((result.draft / "verispec_draft.json").read_text())
    assert meta["kind"] == "feature" and meta["head_vocab"] == 160
    weights = safetensors.torch.load_file(str(result.draft / "draft.safetensors"))
    assert all(VOCAB not in w.shape for w in weights.values())  # no vocabulary-sized table
    assert isinstance(load_drafter(str(result.draft), model, tokenizer), FeatureDrafter)
    assert "native runtime" in (result.draft / "README.md").read_text()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_with_the_feature_draft_equals_plain_greedy(run, target, dtype):
    _, result = run
    model, tokenizer = target
    drafter = load_drafter(str(result.draft), model, tokenizer)
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native", dtype=dtype)
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=4, runtime="native", dtype=dtype)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = ["What is photosynthesis?", "abcabcabc", "Write a poem about the sea."]
    accepted = 0
    for prompt in prompts:
        got = spec.generate(prompt, params)
        assert got.token_ids == plain.generate(prompt, params).token_ids
        assert got.stats.drafted > 0
        accepted += got.stats.accepted
    assert accepted > 0
    together = spec.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                       for n in (40, 13, 27)])
    assert [o.token_ids for o in together] == \
        [plain.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids
         for p, n in zip(prompts, (40, 13, 27), strict=True)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_with_token_trees_equals_plain_greedy_alone_and_in_a_batch(run, target, dtype,
                                                                          monkeypatch):
    """Trees of the head's best continuations, verified in one target pass each: the output
    is still plain greedy decoding's, and paths through other than the first child are taken.
    A sampled row in the same batch drafts chains and gets what it gets alone."""
    _, result = run
    model, tokenizer = target
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native", dtype=dtype)
    prompts = ["What is photosynthesis?", "abcabcabc", "Write a poem about the sea."]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 13, 27)]
    expected = [plain.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    paths = []
    verify_tree = drafts_module.greedy_verify_tree
    monkeypatch.setattr(drafts_module, "greedy_verify_tree", lambda tokens, parents, logits: (
        paths.append((parents.tolist(), verify_tree(tokens, parents, logits)[1]))
        or verify_tree(tokens, parents, logits)))
    batch_trees = []
    for name in (str(result.draft), f"hybrid:{result.draft}"):
        drafter = load_drafter(name, model, tokenizer)
        feature = drafter.model if isinstance(drafter, HybridDrafter) else drafter
        feature.tree_width = feature.sampled_tree_width = 3
        for k in (3, "auto"):
            spec = SpeculativeDecoder(model, tokenizer, drafter, k=k, runtime="native",
                                      dtype=dtype)
            alone = [spec.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
            assert [o.token_ids for o in alone] == expected
            assert [o.token_ids for o in spec.generate(prompts, params)] == expected  # chains
            # trees in a batch too (the scheduler keeps them to batches of one by default)
            spec.config = dataclasses.replace(spec.config, tree_max_batch=3)
            if isinstance(drafter, HybridDrafter):  # not the earlier runs' text: trees
                drafter.lookup.cache.clear()
            before = len(paths)
            assert [o.token_ids for o in spec.generate(prompts, params)] == expected
            if k == 3:  # (auto may find trees too dear for a batch of this tiny model)
                batch_trees.append(len(paths) - before)
    assert min(batch_trees) > 0
    assert paths and max(len(parents) for parents, _ in paths) > 3  # wider than a chain of 3
    # Some accepted node is not its parent's first child: the tree found what a chain missed.
    assert any(parents.index(parents[node]) != node for parents, path in paths for node in path)
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=3, runtime="native", dtype=dtype)
    mixed = spec.generate(prompts[:2], [params[0], sampled])
    assert mixed[0].token_ids == expected[0]
    assert mixed[1].token_ids == spec.generate(prompts[1], sampled).token_ids


def test_verispec_costs_measures_a_feature_draft(run, target_folder, capsys):
    from verispec.cli import main

    _, result = run
    assert main(["costs", "--target", str(target_folder), "--draft", str(result.draft),
                 "--k-max", "2"]) == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert measured["draft_step_c"] > 0 and len(measured["verify_v"]) == 3
    # the draft's step after the long context and what sampling adds per drafted token
    assert measured["sampling_step"] > 0
    assert measured["draft_step_c_long"] is None or measured["draft_step_c_long"] > 0


def test_a_target_without_kept_features_is_refused(run, target):
    _, result = run
    model, tokenizer = target
    drafter = load_drafter(str(result.draft), model, tokenizer)
    with pytest.raises(IncompatibleDraftError, match="native runtime"):
        SpeculativeDecoder(model, tokenizer, drafter, runtime="hf")


def test_hybrid_lookup_with_a_feature_draft_equals_plain_greedy_alone_and_in_a_batch(
        run, target, monkeypatch):
    """Lookup rounds skip the feature draft; it reads the features it missed when it drafts
    next. Output stays the target's, alone and batched."""
    _, result = run
    model, tokenizer = target
    drafter = load_drafter(f"hybrid:{result.draft}", model, tokenizer)
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.model, FeatureDrafter)
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native")
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=4, runtime="native")
    prompts = ["abcabcabc abcabcabc", "What is photosynthesis?", "one two one two one two"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 23, 31)]
    expected = [plain.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    feature_rounds = []
    read = FeatureDrafter._first_to_read
    monkeypatch.setattr(FeatureDrafter, "_first_to_read",
                        lambda self, h, k: feature_rounds.append(read(self, h, k)) or
                        feature_rounds[-1])
    alone = [spec.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in alone] == expected
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    rounds = sum(o.stats.target_forwards for o in alone)
    drafted = sum(first is not None for first in feature_rounds)
    assert 0 < drafted < 2 * rounds  # the feature draft drafted, but not every round
    assert sum(o.stats.accepted for o in alone) > 0


def test_the_first_round_drafts_nothing_then_drafts_from_the_targets_features():
    """With no target features there is nothing to read; after the target's pass the draft reads
    (f_s, x_{s+1}) up to s = L-2, the same way whatever it read before."""
    model = tiny_llama(VOCAB, seed=2, dtype=torch.float32)
    drafter = feature_drafter(model, VOCAB)
    runner = NativeRunner(NativeLlama.from_hf(model, torch.float32))
    drafter.follow(runner)
    history = torch.tensor([5, 6, 7, 8, 9, 10])
    greedy = SamplingParams()
    assert len(drafter.propose(history, 3, greedy, None)) == 0  # no target features yet
    runner.logits(history[:-1], 1)  # the target's pass that produced the last token
    first = drafter.propose(history, 3, greedy, None)
    assert first.depth == 3  # a greedy tree (DEFAULT_TREE_WIDTH wide) three deep
    fresh = feature_drafter(model, VOCAB)
    fresh.follow(runner)
    assert torch.equal(fresh.propose(history, 3, greedy, None).tokens, first.tokens)


def test_a_head_with_taps_drafts_what_training_computes():
    """The drafter's first token reads the target's hidden states after the tapped layers, as
    FeatureHead does in training: the same distribution from the same inputs, and a different
    one without the taps' weights."""
    model = tiny_llama(VOCAB, seed=2, layers=3, dtype=torch.float32)
    shape = LlamaShape.from_config(model.config)
    head = FeatureHead(shape, taps=(1, 2))
    head.init_from(model)
    torch.manual_seed(0)
    torch.nn.init.normal_(head.fc_taps.weight, std=0.3)
    runner = NativeRunner(NativeLlama.from_hf(model, torch.float32))
    zeroed = {**head.state_dict(), "fc_taps.weight": torch.zeros_like(head.fc_taps.weight)}
    drafters = {name: FeatureDrafter(weights, torch.arange(VOCAB), model, VOCAB, taps=(1, 2))
                for name, weights in (("taps", head.state_dict()), ("zeroed", zeroed))}
    for drafter in drafters.values():
        drafter.follow(runner)  # the runner keeps the taps from here on
    history = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    runner.logits(history[:-1], 1)
    sampled = SamplingParams(temperature=1.0)
    drafted = {name: drafter.propose(history, 1, sampled, None).probs[0]  # [V]
               for name, drafter in drafters.items()}
    # Training's view of the same positions: f_s, x_{s+1} and the taps at s = 0..L-2.
    length = history.numel() - 1
    features = runner.features(0, length).unsqueeze(0)
    taps = runner.tapped_states(0, length).unsqueeze(0)  # [1, L-1, 2, H]
    embeddings = model.get_input_embeddings().weight.detach()[history[1:]].unsqueeze(0)
    with torch.no_grad():
        predicted = head(features, embeddings, taps)[0, -1]
    expected = FrozenHead(model, torch.arange(VOCAB)).log_probs(predicted).exp()
    torch.testing.assert_close(drafted["taps"], expected, rtol=1e-4, atol=1e-5)
    assert (drafted["zeroed"] - expected).abs().max() > 1e-3


def test_feature_taps_are_checked():
    model = tiny_llama(VOCAB, seed=2, layers=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="inside the target"):
        FeatureHead(LlamaShape.from_config(model.config), taps=(3,))
    with pytest.raises(ValueError, match="feature_taps"):
        DistillConfig(out=Path("x"), feature_taps=(1,))  # kind "layers"
    with pytest.raises(ValueError, match="feature_taps"):
        DistillConfig(out=Path("x"), kind="feature", feature_taps=(0,))
    runner = NativeRunner(NativeLlama.from_hf(model, torch.float32))
    runner.keep_taps((2,))
    with pytest.raises(IncompatibleDraftError, match="another feature draft"):
        FeatureDrafter({}, torch.arange(VOCAB), model, VOCAB, taps=(1,)).follow(runner)
    untapped = feature_drafter(model, VOCAB)
    untapped.follow(runner)  # a head without taps reads none: no conflict
    assert runner.tap_layers == (2,)


def test_distill_with_taps_writes_a_draft_that_reads_them_and_keeps_greedy_exact(
        target_folder, target):
    config = DistillConfig(out=target_folder.parent / "run-taps", target=str(target_folder),
                           kind="feature", feature_taps=(1, 2), num_prompts=16, self_prompts=0,
                           eval_prompts=8, shard_prompts=8, max_new_tokens=24, batch_size=8,
                           head_vocab=160, steps=30, lr=3e-3, checkpoint_every=30,
                           device="cpu")
    result = distill(config)
    meta = json.loads((result.draft / "verispec_draft.json").read_text())
    assert meta["taps"] == [1, 2]
    weights = safetensors.torch.load_file(str(result.draft / "draft.safetensors"))
    assert weights["fc_taps.weight"].float().abs().sum() > 0  # trained away from zero
    card = (result.draft / "README.md").read_text()
    assert "--feature-taps 1 2" in card and "after its layers 1, 2" in card
    model, tokenizer = target
    drafter = load_drafter(str(result.draft), model, tokenizer)
    assert drafter.taps == (1, 2)
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native")
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=3, runtime="native")
    prompts = ["What is photosynthesis?", "abcabcabc"]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outputs = spec.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [plain.generate(p, params).token_ids
                                              for p in prompts]
    assert sum(o.stats.drafted for o in outputs) > 0
    # Resuming the run with other taps is refused, before any training.
    with pytest.raises(ValueError, match="another shape"):
        distill(dataclasses.replace(config, feature_taps=(1,), steps=40, resume=True))
    # A folder whose taps do not fit its weights is refused.
    meta["taps"] = []
    (result.draft / "verispec_draft.json").write_text(json.dumps(meta))
    with pytest.raises(IncompatibleDraftError, match="taps"):
        load_drafter(str(result.draft), model, tokenizer)


# -- the law of sampled output with a feature draft ----------------------------------------------

V = 8
PROMPT = [1, 2, 3, 1, 2]
SAMPLES = 3000
PARAMS = SamplingParams(temperature=1.0)


def native_joint_of_tokens_2_and_3(model) -> torch.Tensor:
    """p(t2, t3) [V, V] = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), native bf16."""
    runner = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))

    def law(ids: list[int]) -> torch.Tensor:
        return warp(runner.logits(torch.tensor(ids), 1)[0], PARAMS).double()

    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1, p1 in enumerate(law(PROMPT)):
        second = law(PROMPT + [t1])
        for t2 in range(V):
            joint[t2] += p1 * second[t2] * law(PROMPT + [t1, t2])
    return joint


def counts_of_tokens_2_and_3(model, tree_width: int = 1) -> torch.Tensor:
    """Round 1 is a plain step (no features yet); round 2 drafts t2 (with a tree width: three
    candidates for it, drawn independently, each with a child) and draws t3 as an accepted
    child, the correction or the bonus token."""
    decoder = SpeculativeDecoder(model, None, feature_drafter(model, V, tree_width), k=3,
                                 runtime="native")
    counts = torch.zeros(V, V, dtype=torch.float64)
    rows = 100
    for batch in range(SAMPLES // rows):
        params = [SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True,
                                 seed=batch * rows + row) for row in range(rows)]
        for output in decoder.generate([PROMPT] * rows, params):
            counts[output.token_ids[1], output.token_ids[2]] += 1
    return counts


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(V, seed=3, init=0.5, dtype=torch.float32)


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chains", "sampled-trees"])
def test_sampled_tokens_with_a_feature_draft_have_the_targets_law(small_target, tree_width):
    counts = counts_of_tokens_2_and_3(small_target, tree_width)
    assert chi2_pvalue(counts, native_joint_of_tokens_2_and_3(small_target)) > 1e-3


def first_child_always(tokens, parents, draft_probs, target_probs, generator):
    """Negative control for sampled trees: accept the first child at every level."""
    path, node = [], -1
    while (children := (parents == node).nonzero()).numel():
        node = int(children[0, 0])
        path.append(node)
    bonus = int(torch.multinomial(target_probs[node + 1], 1, generator=generator)[0])
    return [int(tokens[i]) for i in path] + [bonus], path


@pytest.mark.parametrize("tree_width", [1, 3], ids=["chains", "sampled-trees"])
def test_negative_control_always_accept_with_a_feature_draft_is_detected(small_target,
                                                                         monkeypatch,
                                                                         tree_width):
    monkeypatch.setattr("verispec.verify.drafts.verify_rows", always_accept_rows)
    monkeypatch.setattr("verispec.verify.drafts.rejection_sample_tree", first_child_always)
    counts = counts_of_tokens_2_and_3(small_target, tree_width)
    assert chi2_pvalue(counts, native_joint_of_tokens_2_and_3(small_target)) < 1e-6


@pytest.mark.parametrize("room", [1, 2, 5, 9])
def test_trees_near_the_end_of_the_context_fit_in_it(run, target, room):
    """A prompt that leaves `room` positions of the context: the feature draft grows its trees
    no deeper than its cache has slots for, the target verifies no more nodes than fit, and the
    output is plain greedy decoding's up to the context (it had stopped with "exceeds the
    model's context" where trees of width 8 were drafted past the end). Sampled trees (opt-in)
    are dropped where they do not fit."""
    _, result = run
    model, tokenizer = target
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native")
    positions = plain.target.max_positions
    prompt = torch.randint(3, VOCAB, (positions - room,),
                           generator=torch.Generator().manual_seed(room)).tolist()
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    expected = plain.generate(prompt, params).token_ids
    assert len(expected) == room
    drafter = load_drafter(str(result.draft), model, tokenizer)
    drafter.tree_width = drafter.sampled_tree_width = 8
    for k in (6, "auto"):
        spec = SpeculativeDecoder(model, tokenizer, drafter, k=k, runtime="native")
        assert spec.generate(prompt, params).token_ids == expected
    sampled = SamplingParams(max_new_tokens=64, temperature=1.0, seed=5, ignore_eos=True,
                             verify="invariant")
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=6, runtime="native")
    assert spec.generate(prompt, sampled).token_ids == plain.generate(prompt, sampled).token_ids
