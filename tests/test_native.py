"""The native Llama runtime: logits equal transformers', rollback is
exact, and in bfloat16 a position's logits do not depend on how many positions the pass holds."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from verispec import SamplingParams, SpeculativeDecoder
from verispec.runtime.native import NativeLlama, NativeRunner, UnsupportedModelError
from verispec.runtime.native import layers as native_layers
from verispec.runtime.native.layers import Linear

IDS = torch.randint(0, 64, (80,), generator=torch.Generator().manual_seed(0))


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, use_sliding_window=False,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [lambda: tiny_llama(64, seed=0, dtype=torch.float32),
                                  tiny_qwen2], ids=["llama-gqa", "qwen2-bias-tied"])
def test_logits_equal_transformers_in_fp32(make):
    model = make()
    with torch.no_grad():
        reference = model(IDS.unsqueeze(0)).logits[0]  # [80, V]
    native = NativeLlama.from_hf(model, torch.float32)
    cache = native.new_cache()
    prefill = native.forward(IDS[:70], 0, 70, cache)  # batched causal attention
    verify = native.forward(IDS[70:], 70, 10, cache)  # query-by-query attention
    torch.testing.assert_close(prefill, reference[:70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify, reference[70:], rtol=1e-4, atol=1e-4)


def test_rollback_then_forward_equals_fresh_forward():
    model = tiny_llama(64, seed=1, dtype=torch.float32)
    runner = NativeRunner(NativeLlama.from_hf(model, torch.float32))
    fresh = NativeRunner(NativeLlama.from_hf(model, torch.float32))
    for cached in (fresh, runner):
        cached.logits(IDS[:60], 1)
        cached.logits(IDS[:72], 1)
    expected = fresh.logits(IDS, 8)  # never rolled back
    runner.logits(torch.cat([IDS[:72], (IDS[72:77] + 1) % 64]), 5)  # a rejected draft
    assert torch.equal(runner.logits(IDS, 8), expected)


def test_bf16_logits_do_not_depend_on_pass_size():
    native = NativeLlama.from_hf(tiny_llama(64, seed=2, dtype=torch.float32), torch.bfloat16)
    runner = NativeRunner(native)
    runner.logits(IDS[:60], 1)
    steps = [runner.logits(IDS[:n], 1)[0] for n in range(61, 70)]  # one position per pass
    runner.rollback(60)
    together = runner.logits(IDS[:69], 9)  # the same nine positions in one pass
    for one, many in zip(steps, together, strict=True):
        assert torch.equal(one, many)


@pytest.mark.parametrize("in_features", [576, 1536], ids=["K576", "K1536"])
def test_bf16_linear_on_the_torch_path_gives_a_row_the_same_bits_in_any_call(in_features,
                                                                             monkeypatch):
    """The PyTorch path's bf16 layers (oneDNN, prepacked): every row of 64, in calls of 1..16
    rows, equals the 64-row call's. SmolLM2's shapes; K = 1536 (its down projection) rounded a
    lone row differently on an AMD EPYC until calls of one row were padded to two."""
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    generator = torch.Generator().manual_seed(5)
    linear = Linear((torch.randn(576, in_features, generator=generator) * 0.03).bfloat16())
    assert linear.tiles is None
    x = torch.randn(64, in_features, generator=generator).bfloat16()
    with torch.inference_mode():
        together = linear(x)
        for m in range(1, 17):
            for first in range(0, 64 - m + 1, m):
                assert torch.equal(linear(x[first:first + m]), together[first:first + m]), m


def test_a_layer_that_rounds_a_lone_row_differently_is_padded_to_two_rows(monkeypatch):
    """The probe behind the test above, against a layer made to disagree with itself: a product
    that rounds differently when the call holds one row gets min_rows 2, and its one-row calls
    then give the wider calls' bits; the control (no padding) differs."""
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    monkeypatch.setattr(native_layers, "_ROWS_PROBED", {})
    product = Linear._product

    def lone_row_rounds_up(self, x):
        y = product(self, x)
        return y + y.abs() * 2 ** -6 if x.shape[0] == 1 else y  # a bf16 ulp or two

    monkeypatch.setattr(Linear, "_product", lone_row_rounds_up)
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 64, generator=generator).bfloat16()
    linear = Linear(weight)
    assert linear.min_rows == 2
    x = torch.randn(8, 64, generator=generator).bfloat16()
    assert torch.equal(linear(x[3:4]), linear(x)[3:4])
    assert not torch.equal(linear._product(x[3:4]), linear(x)[3:4])  # the control
    assert Linear(weight.float()).min_rows == 1  # float32: no bitwise promise to keep


def test_speculative_greedy_equals_plain_greedy_on_the_native_runtime_in_bf16(tokenizer):
    from verispec.drafters import NgramDrafter

    model = tiny_llama(len(tokenizer), seed=3, dtype=torch.float32)
    plain = SpeculativeDecoder(model, tokenizer, None, runtime="native", dtype="bfloat16")
    spec = SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=4, runtime="native",
                              dtype="bfloat16")
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for prompt in ["abcabcabc", "hello hello hello"]:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_unsupported_architectures_are_refused():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        NativeLlama.from_hf(tiny_gpt2(64, seed=0))


def test_auto_runtime_takes_native_for_llama_and_falls_back_otherwise():
    from verispec.runtime import HFRunner, make_runner

    llama32 = tiny_llama(64, seed=0, dtype=torch.float32)
    native = make_runner(llama32, "auto")
    assert isinstance(native, NativeRunner) and native.describe().startswith("native bfloat16")
    assert make_runner(llama32, "auto", dtype="float32").describe() == "native float32"
    assert type(make_runner(llama32, "hf")) is HFRunner
    assert type(make_runner(tiny_gpt2(64, seed=0, dtype=torch.float32), "auto")) is HFRunner
    assert type(make_runner(tiny_llama(64, seed=0), "auto")) is HFRunner  # float64 stays hf
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        make_runner(tiny_gpt2(64, seed=0, dtype=torch.float32), "native")
    with pytest.raises(ValueError, match="native runtime"):
        make_runner(llama32, "hf", int8=True)
    with pytest.raises(ValueError, match="runtime must be"):
        make_runner(llama32, "tpu")


def test_int8_weights_stay_close_to_bf16_and_are_batch_invariant():
    model = tiny_llama(64, seed=4, init=0.05, dtype=torch.float32)
    bf16 = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    int8 = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16, int8=True))
    assert int8.describe().startswith("native bfloat16 int8 weights")
    reference, quantized = bf16.logits(IDS, 20), int8.logits(IDS, 20)
    assert (reference - quantized).abs().max() < 0.05 * reference.abs().max()
    assert (reference.argmax(-1) == quantized.argmax(-1)).float().mean() >= 0.9
    int8.rollback(70)
    steps = [int8.logits(IDS[:n], 1)[0] for n in range(71, 81)]
    int8.rollback(70)
    for one, many in zip(steps, int8.logits(IDS, 10), strict=True):
        assert torch.equal(one, many)
    with pytest.raises(ValueError, match="bfloat16"):
        NativeLlama.from_hf(model, torch.float32, int8=True)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_draft_model_on_the_native_runtime_keeps_greedy_exact(tokenizer, int8):
    from verispec.drafters import ModelDrafter
    from verispec.runtime import make_runner

    target = tiny_llama(len(tokenizer), seed=5, dtype=torch.float32)
    draft = tiny_llama(len(tokenizer), seed=6, dtype=torch.float32, layers=1)
    plain = SpeculativeDecoder(target, tokenizer, None, runtime="native", int8=int8)
    drafter = ModelDrafter(make_runner(draft, "native", int8=int8), len(tokenizer))
    assert drafter.runner.describe().startswith("native")
    spec = SpeculativeDecoder(target, tokenizer, drafter, k=3, runtime="native", int8=int8)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ["abcabc", "the cat sat on the mat"]:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_a_prompt_pass_with_draft_tokens_caches_what_the_prompt_alone_caches():
    """A speculative first round feeds prompt + draft; plain decoding feeds the prompt alone.
    The prompt's keys/values and last logits must be the same bits either way (found on a
    Spec-Bench RAG prompt: a 869-position pass rounded differently from an 868-position one)."""
    model = tiny_llama(64, seed=7, dtype=torch.float32)
    prompt, draft = IDS[:50], IDS[50:54]
    plain = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    spec = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    first = plain.logits(prompt, 1)
    together = spec.logits(torch.cat([prompt, draft]), 5)
    assert torch.equal(together[0], first[0])
    for length in range(51, 55):  # the draft positions, one by one as plain decoding does them
        assert torch.equal(plain.logits(IDS[:length], 1)[0], together[length - 50])
    assert torch.equal(plain.cache.keys[:, :, :54], spec.cache.keys[:, :, :54])


def test_speculative_greedy_equals_plain_greedy_with_long_prompts_in_bf16(tokenizer):
    from verispec.drafters import NgramDrafter

    model = tiny_llama(len(tokenizer), seed=8, dtype=torch.float32)
    runner = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    plain = SpeculativeDecoder(model, tokenizer, None, runtime=runner)
    spec = SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=4, runtime=runner)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ["the cat sat on the mat and the cat sat on the hat " * 3,
                   "def f(x): return x + 1\ndef g(x): return f(x) * 2\n" * 2]:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    for prompts in (["a b c a b c a b c a b c a b c a b c", "x"], ["q" * 30, "w e" * 20]):
        assert [o.token_ids for o in spec.generate(prompts, params)] == \
            [plain.generate(p, params).token_ids for p in prompts]


def test_taps_keep_the_hidden_states_inside_the_stack_and_change_no_logit():
    """A feature draft with taps reads the hidden state after some of the target's layers
    (NativeRunner.keep_taps): kept per position, equal to transformers' hidden states, and the
    logits are the same bits with or without them."""
    model = tiny_llama(64, seed=1, layers=3, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(IDS.unsqueeze(0), output_hidden_states=True).hidden_states
    native = NativeLlama.from_hf(model, torch.float32)
    logits = {}
    for taps in ((), (2, 1)):
        runner = NativeRunner(native)
        runner.keep_taps(taps)
        logits[taps] = torch.cat([runner.logits(IDS[:70], 1), runner.logits(IDS, 10)])
    assert torch.equal(logits[()], logits[(2, 1)])
    tapped = runner
    taps = tapped.tapped_states(0, IDS.numel())  # [T, 2, H]
    torch.testing.assert_close(taps[:, 0], hidden[2][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(taps[:, 1], hidden[1][0], rtol=1e-4, atol=1e-4)
