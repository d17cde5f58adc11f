"""Streaming, stop strings, loading from folders, and clear errors on bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, feature_drafter, tiny_gpt2, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.config import EngineConfig
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.drafters.load import load_drafter
from verispec.errors import IncompatibleDraftError, ModelNotFoundError


@pytest.fixture
def decoder(text_target, tokenizer):
    return SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k=4)


def test_stream_pieces_add_up_to_the_output(decoder):
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    chunks = list(decoder.stream("abcabcabc", params))
    output = chunks[-1].output
    assert output is not None and all(c.output is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == output.text
    assert [t for c in chunks for t in c.token_ids] == output.token_ids
    assert output.token_ids == decoder.generate("abcabcabc", params).token_ids


def test_stop_string_cuts_text_and_tokens(decoder, tokenizer):
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    full = decoder.generate("abcabcabc", params)
    stop = full.text[10:13]
    cut_at = full.text.index(stop)
    stopped = decoder.generate("abcabcabc", SamplingParams(max_new_tokens=60, ignore_eos=True,
                                                            stop=(stop,)))
    assert stopped.text == full.text[:cut_at]
    assert stopped.finish_reason == "stop"
    assert full.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    assert stop in tokenizer.decode(stopped.token_ids)  # the ids reach the stop string ...
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])  # ... and not one id further
    assert stopped.stats.new_tokens == len(stopped.token_ids) < full.stats.new_tokens
    streamed = list(decoder.stream("abcabcabc", SamplingParams(max_new_tokens=60,
                                                                ignore_eos=True, stop=(stop,))))
    assert "".join(c.text for c in streamed) == stopped.text


def test_stats_count_the_tokens_the_output_keeps_at_a_stop_string(decoder):
    """A round that writes a stop string and tokens after it: the stats count the output's
    tokens (as usage does), not those the round wrote past the stop, at every stop place."""
    full = decoder.generate("abcabcabc", SamplingParams(max_new_tokens=60, ignore_eos=True))
    overshot = 0
    for cut in range(2, 40, 3):
        stop = full.text[cut:cut + 2]
        out = decoder.generate("abcabcabc", SamplingParams(max_new_tokens=60, ignore_eos=True,
                                                           stop=(stop,)))
        assert out.stats.new_tokens == len(out.token_ids)
        assert out.stats.tokens_per_forward == len(out.token_ids) / out.stats.target_forwards
        overshot += out.stats.target_forwards < len(out.token_ids)  # rounds of several tokens
    assert overshot  # the case in question was met


@pytest.mark.parametrize("k", [3, "auto"])
def test_a_draft_gone_nan_leaves_the_output_the_targets(tokenizer, k):
    """A draft model whose weights are NaN (a distillation that diverged) cannot be drawn
    from: it proposes nothing, and greedy and seeded sampled output are plain decoding's,
    with K fixed or auto (whose cost model times a sampled draft step), on both runtimes."""
    target = tiny_llama(EOS_ID + 1, seed=0, dtype=torch.float32)  # (the fixture is float64)
    broken = tiny_llama(EOS_ID + 1, seed=1).float()
    with torch.no_grad():
        for weight in broken.parameters():
            weight.fill_(float("nan"))
    for runtime in ("native", "hf"):
        plain = SpeculativeDecoder(target, tokenizer, None, runtime=runtime)
        spec = SpeculativeDecoder(target, tokenizer, ModelDrafter(broken, EOS_ID + 1), k=k,
                                  runtime=runtime)
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=12, ignore_eos=True,
                                    temperature=temperature, seed=3)
            assert spec.generate("hello", params).token_ids == \
                plain.generate("hello", params).token_ids


@pytest.mark.parametrize("width", [1, 3], ids=["chains", "trees"])
def test_a_feature_draft_gone_nan_leaves_the_output_the_targets(tokenizer, width):
    """The same for a feature draft, chains and token trees (a sampled tree whose
    distributions cannot be drawn from stops growing)."""
    from verispec.drafters.feature import FeatureDrafter

    target = tiny_llama(EOS_ID + 1, seed=0, dtype=torch.float32)  # (the fixture is float64)
    weights = feature_drafter(target, EOS_ID + 1).weights
    broken = FeatureDrafter({name: torch.full_like(w, float("nan")) for name, w in weights.items()},
                            torch.arange(EOS_ID + 1), target, EOS_ID + 1, tree_width=width,
                            sampled_tree_width=width)
    plain = SpeculativeDecoder(target, tokenizer, None, runtime="native")
    spec = SpeculativeDecoder(target, tokenizer, broken, k=3, runtime="native")
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature,
                                seed=3)
        assert spec.generate("hello", params).token_ids == \
            plain.generate("hello", params).token_ids


def test_finish_reasons(decoder):
    assert decoder.generate("abc", SamplingParams(max_new_tokens=3, ignore_eos=True)
                            ).finish_reason == "length"


def test_token_id_prompts_and_model_without_tokenizer(text_target):
    decoder = SpeculativeDecoder(text_target, None, NgramDrafter(), k=3)
    out = decoder.generate([5, 6, 7, 5, 6], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(out.token_ids) == 10 and out.text == ""
    with pytest.raises(ValueError, match="token ids"):
        decoder.generate("text prompt", SamplingParams())


def test_from_pretrained_with_folders(model_folders, tokenizer):
    decoder = SpeculativeDecoder.from_pretrained(target=model_folders / "target",
                                                 draft=model_folders / "draft", k=3)
    plain = SpeculativeDecoder.from_pretrained(target=model_folders / "target", draft=None)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert decoder.generate("xyz", params).token_ids == plain.generate("xyz", params).token_ids


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt(decoder, prompt):
    with pytest.raises(ValueError, match="empty"):
        decoder.generate(prompt, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        decoder.stream(prompt, SamplingParams())  # before any iteration


def test_out_of_range_token_ids(decoder):
    with pytest.raises(ValueError, match="token ids"):
        decoder.generate([1, 99999], SamplingParams())


def test_prompt_longer_than_context(decoder):
    with pytest.raises(ValueError, match="context"):
        decoder.generate([1] * 2100, SamplingParams())


@pytest.mark.parametrize("k", [-1, 2.5, True])
def test_bad_k(text_target, tokenizer, k):
    with pytest.raises(ValueError, match="k must be"):
        SpeculativeDecoder(text_target, tokenizer, NgramDrafter(), k=k)


@pytest.mark.parametrize("width", [0, 16, 2.0, True])
def test_bad_tree_width(tmp_path, width):
    with pytest.raises(ValueError, match="tree width must be"):
        SpeculativeDecoder.from_pretrained(target=tmp_path / "nope", tree_width=width)
    with pytest.raises(ValueError, match="tree width must be"):
        SpeculativeDecoder.from_pretrained(target=tmp_path / "nope", sampled_tree_width=width)


def test_missing_model_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        SpeculativeDecoder.from_pretrained(target=tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        SpeculativeDecoder.from_pretrained(target=tmp_path)


def test_vocabulary_mismatch(text_target, tokenizer, tmp_path):
    small = tiny_gpt2(100, seed=0)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        load_drafter(tmp_path / "small", text_target, tokenizer)
    tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(IncompatibleDraftError, match="vocabulary mismatch"):
        load_drafter(tmp_path / "small", text_target, tokenizer)


def test_padding_rows_beyond_the_tokenizer_are_allowed(text_target, tokenizer, tmp_path):
    padded = tiny_gpt2(len(tokenizer) + 63, seed=0)  # embedding padded to a multiple of 64
    padded.save_pretrained(tmp_path / "padded")
    tokenizer.save_pretrained(tmp_path / "padded")
    drafter = load_drafter(tmp_path / "padded", text_target, tokenizer)
    decoder = SpeculativeDecoder(text_target, tokenizer, drafter, k=3)
    plain = SpeculativeDecoder(text_target, tokenizer, None)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert decoder.generate("pad", params).token_ids == plain.generate("pad", params).token_ids
    sampled = decoder.generate("pad", SamplingParams(max_new_tokens=20, temperature=1, seed=0,
                                                     ignore_eos=True))
    assert len(sampled.token_ids) == 20 and max(sampled.token_ids) < len(tokenizer)


def test_greedy_ignores_generator_state(decoder):
    torch.manual_seed(0)
    a = decoder.generate("abc", SamplingParams(max_new_tokens=10))
    torch.manual_seed(1)
    assert decoder.generate("abc", SamplingParams(max_new_tokens=10)).token_ids == a.token_ids


def test_bad_arguments_raise_value_error_naming_the_fault(decoder):
    """What a library user gets wrong is a ValueError that says what, before anything runs:
    not an AttributeError, a TypeError from the tokenizer, or a failure midway."""
    cases = [
        (lambda: decoder.generate("hi", {"max_new_tokens": 4}), "SamplingParams"),
        (lambda: list(decoder.stream(["a", "b"])), "list of texts"),
        (lambda: decoder.generate([{"role": "user", "content": "hi"}]), "not chat messages"),
        (lambda: decoder.generate("\udcff hi"), "not valid Unicode"),
        (lambda: decoder.generate("hi", prediction="\udcff"), "not valid Unicode"),
        (lambda: SamplingParams(temperature=float("inf")), "finite"),
        (lambda: SamplingParams(ignore_eos="no"), "ignore_eos"),
        (lambda: EngineConfig(device="bogus"), "device"),
        (lambda: EngineConfig(target=""), "target is empty"),
        (lambda: EngineConfig(draft=" "), "draft is empty"),
        (lambda: EngineConfig(int8=True, runtime="hf"), "native runtime"),
    ]
    if not torch.cuda.is_available():
        cases.append((lambda: EngineConfig(device="cuda"), "no CUDA GPU"))
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    assert decoder.generate("hi", SamplingParams(max_new_tokens=2)).token_ids  # still serves
