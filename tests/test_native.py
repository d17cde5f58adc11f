"""The native Llama runtime (groundwork for issue 4): logits equal transformers', rollback is
exact, and in bfloat16 a position's logits do not depend on how many positions the pass holds."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from verispec import SamplingParams, SpeculativeDecoder
from verispec.native import NativeCachedModel, NativeLlama, UnsupportedModelError

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
    prefill = native.forward(IDS[:70], start=0, num_logits=70)  # batched causal attention
    verify = native.forward(IDS[70:], start=70, num_logits=10)  # query-by-query attention
    torch.testing.assert_close(prefill, reference[:70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify, reference[70:], rtol=1e-4, atol=1e-4)


def test_rollback_then_forward_equals_fresh_forward():
    native = NativeLlama.from_hf(tiny_llama(64, seed=1, dtype=torch.float32), torch.float32)
    runner = NativeCachedModel(native)
    fresh = NativeCachedModel(NativeLlama.from_hf(tiny_llama(64, seed=1, dtype=torch.float32),
                                                  torch.float32)).logits(IDS, 8)
    runner.logits(IDS[:60], 1)
    runner.logits(torch.cat([IDS[:72], (IDS[72:77] + 1) % 64]), 6)  # a rejected draft
    torch.testing.assert_close(runner.logits(IDS, 8), fresh, rtol=1e-6, atol=1e-6)


def test_bf16_logits_do_not_depend_on_pass_size():
    native = NativeLlama.from_hf(tiny_llama(64, seed=2, dtype=torch.float32), torch.bfloat16)
    runner = NativeCachedModel(native)
    runner.logits(IDS[:60], 1)
    steps = [runner.logits(IDS[:n], 1)[0] for n in range(61, 70)]  # one position per pass
    runner.rollback(60)
    together = runner.logits(IDS[:69], 9)  # the same nine positions in one pass
    for one, many in zip(steps, together, strict=True):
        assert torch.equal(one, many)


def test_speculative_greedy_equals_plain_greedy_on_the_native_runtime_in_bf16(tokenizer):
    from verispec.drafters import NgramDrafter

    model = tiny_llama(len(tokenizer), seed=3, dtype=torch.float32)
    native = NativeLlama.from_hf(model, torch.bfloat16)
    plain = SpeculativeDecoder(model, tokenizer, None)
    spec = SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=4)
    plain.target = NativeCachedModel(native)
    spec.target = NativeCachedModel(NativeLlama.from_hf(model, torch.bfloat16))
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for prompt in ["abcabcabc", "hello hello hello"]:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_unsupported_architectures_are_refused():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        NativeLlama.from_hf(tiny_gpt2(64, seed=0))
