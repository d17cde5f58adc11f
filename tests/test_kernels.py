"""verispec's C++ kernels (runtime/native/kernels.cpp): the linear layer and the fused bfloat16
decoder forward agree with fp32 maths, transformers and the PyTorch path, and give a position the
same bits in every pass shape. They run on AMX where the CPU has it, else on AVX512-BF16
(VERISPEC_KERNELS=avx512 forces the latter on an AMX machine); skipped where the CPU has
neither; the PyTorch path these fall back to keeps its own tests (forced on here with
VERISPEC_KERNELS=0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters import NgramDrafter
from verispec.runtime.native import NativeLlama, NativeRunner, batched_logits, bf16_kernels

IDS = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def kernels():
    module = bf16_kernels.load()
    if module is None:
        pytest.skip("verispec's C++ kernels do not run here (no AVX512-BF16, or no compiler)")
    return module


def tiny(kind: str, head_dim: int = 32):
    """bf16 models whose sizes the kernels take, with a vocabulary that is not a multiple of
    the kernel's 32-feature blocks. On an AMX machine head_dim 64 and 32 attend on AMX (64 on
    its own path), 16 on the AVX-512 path; without AMX every width takes the AVX-512 path."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=96,
                  num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False,
                                             tie_word_embeddings=True))
    return model.to(torch.bfloat16).eval()


def test_linear_matches_fp32_and_a_row_does_not_depend_on_the_row_count(kernels):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 96, generator=generator).bfloat16()  # 100: a padded last block
    bias = torch.randn(100, generator=generator)
    x = torch.randn(40, 96, generator=generator).bfloat16()  # 40 rows: three 16-row tiles
    tiles = kernels.pack(weight)
    none = torch.empty(0)
    y = kernels.linear(x, tiles, bias, none, 100)
    reference = x.float() @ weight.float().T + bias
    # fp32 accumulation, one rounding to bf16: within half a bf16 ulp of the exact value.
    assert ((y.float() - reference).abs() <= reference.abs() * 2 ** -8 + 1e-3).all()
    for first, last in [(0, 1), (5, 6), (3, 20), (17, 40), (0, 16), (39, 40)]:
        assert torch.equal(kernels.linear(x[first:last], tiles, bias, none, 100),
                           y[first:last])
    # int8 weights: the same product over the dequantized weights, also row-count free.
    scales = weight.float().abs().amax(dim=1) / 127
    quantized = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    y8 = kernels.linear(x, kernels.pack(quantized), bias, scales, 100)
    reference = x.float() @ (quantized.float() * scales[:, None]).T + bias
    assert ((y8.float() - reference).abs() <= reference.abs() * 2 ** -8 + 1e-3).all()
    for first, last in [(0, 1), (3, 20), (17, 40)]:
        assert torch.equal(kernels.linear(x[first:last], kernels.pack(quantized), bias, scales,
                                          100), y8[first:last])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack(torch.zeros(8, 40, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["llama", "qwen2"], ids=["llama-gqa", "qwen2-bias-tied"])
def test_fused_forward_matches_transformers_and_the_torch_path(kind, kernels, monkeypatch):
    model = tiny(kind)
    fused = NativeLlama.from_hf(model)
    assert fused.fused is not None
    assert fused.describe().endswith(f"(C++ kernels, {kernels.isa.upper()})")
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    torch_path = NativeLlama.from_hf(model)
    assert torch_path.fused is None
    with torch.no_grad():
        reference = model(IDS.unsqueeze(0)).logits[0].float()  # [90, V], transformers in bf16
    got = {}
    for name, native in (("fused", fused), ("torch", torch_path)):
        cache = native.new_cache()
        got[name] = torch.cat([native.forward(IDS[:80], 0, 80, cache),
                               native.forward(IDS[80:], 80, 10, cache)])
    # bf16 runs round at every op, each path in its own order: the fused path is to stay as
    # close to transformers as the PyTorch path is.
    error = {name: (logits - reference).abs().max() for name, logits in got.items()}
    assert error["fused"] <= 1.5 * error["torch"] + 1e-3, error
    assert error["fused"] < 0.05 * reference.abs().max(), error
    assert (got["fused"].argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


def test_fused_taps_match_the_torch_path_and_change_no_logit(kernels, monkeypatch):
    """The C++ forward keeps the hidden state after the tapped layers, as the PyTorch path does,
    without touching a logit."""
    model = tiny("llama")
    fused = NativeLlama.from_hf(model)
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    torch_path = NativeLlama.from_hf(model)
    cache = fused.new_cache()
    plain = torch.cat([fused.forward(IDS[:80], 0, 1, cache), fused.forward(IDS[80:], 80, 4,
                                                                           cache)])
    taps = {}
    for name, native in (("fused", fused), ("torch", torch_path)):
        cache = native.new_cache(tap_layers=(1,))
        logits = native.forward(IDS[:80], 0, 1, cache)
        logits = torch.cat([logits, native.forward(IDS[80:], 80, 4, cache)])
        taps[name] = cache.taps[:90, 0].float()  # [90, H]
        if name == "fused":
            assert torch.equal(logits, plain)
    error = (taps["fused"] - taps["torch"]).abs().max()
    assert error < 0.02 * taps["torch"].abs().max(), error
    assert taps["fused"].abs().sum() > 0


@pytest.mark.parametrize("head_dim", [64, 32, 16],
                         ids=["amx-attention-d64", "amx-attention", "avx512-attention"])
def test_fused_logits_are_the_same_bits_in_every_pass_shape(kernels, head_dim):
    native = NativeLlama.from_hf(tiny("llama", head_dim))
    steps = NativeRunner(native)
    steps.logits(IDS[:40], 1)  # a prompt pass (its own rounding: prompts run alone)
    one_by_one = torch.cat([steps.logits(IDS[:n], 1) for n in range(41, 91)])  # [50, V]
    # Passes of 5 and 16 positions give the same bits.
    wide = NativeRunner(native)
    wide.logits(IDS[:40], 1)
    in_passes = torch.cat([wide.logits(IDS[:n], 5 if n <= 60 else 15)
                           for n in (45, 50, 55, 60, 75, 90)])
    assert torch.equal(in_passes, one_by_one)
    # Rows of different lengths and positions in one pass, each as alone, next to a prompt.
    rows = [NativeRunner(native) for _ in range(3)]
    for runner in rows[:2]:
        runner.logits(IDS[:40], 1)
    rows[0].logits(IDS[:56], 16)
    rows[0].logits(IDS[:60], 4)
    together = batched_logits(rows, [IDS[:65], IDS[:56], IDS[:30]], [5, 16, 1])
    assert torch.equal(together[0], one_by_one[20:25])  # positions 60..64
    assert torch.equal(together[1], one_by_one[:16])
    alone = NativeRunner(native)
    assert torch.equal(together[2], alone.logits(IDS[:30], 1))


@pytest.mark.parametrize("head_dim", [64, 128, 32, 48])
def test_attention_gives_a_query_the_same_bits_alone_or_with_others(kernels, head_dim):
    """The AVX512-BF16 attention transposes each block of 16 keys once for all the queries that
    share it and sums their values side by side (head widths 32, 64, 128; others go query by
    query); a query must get the bits it gets alone (a decode step's), and both agree with fp32
    attention. The fp32 softmax numerators show a rounding difference that the bf16 outputs
    mostly round away: summing a block's four partial scores in another order (tried) fails
    this on them, not on the outputs."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        keys, values = (torch.randn(700, head_dim, generator=g).bfloat16() for _ in range(2))
        queries = (torch.randn(24, head_dim, generator=g) * 0.5).bfloat16()
        counts = [1, 2, 3, 16, 17, 33] + torch.randint(100, 701, (18,), generator=g).tolist()
        together, together_numerators = kernels.attend(queries, keys, values, counts, True)
        alone, alone_numerators = kernels.attend(queries, keys, values, counts, False)
        assert torch.equal(together_numerators, alone_numerators)
        assert torch.equal(together, alone)
        for query, count, out in zip(queries.float(), counts, together.float(), strict=True):
            weights = torch.softmax(keys[:count].float() @ query / head_dim ** 0.5, dim=0)
            torch.testing.assert_close(out, weights @ values[:count].float(), atol=2e-2,
                                       rtol=2e-2)


def test_the_avx512_path_on_an_amx_machine(kernels):
    """Where the CPU has AMX this file's tests run on it; the AVX512-BF16 path that CPUs without
    AMX take (VERISPEC_KERNELS=avx512, read once per process) is run here in a process of its
    own over the same tests. Without AMX the tests above ran on that path already."""
    if kernels.isa != "amx":
        pytest.skip("no AMX here: every test above ran on the AVX512-BF16 path")
    if os.environ.get("VERISPEC_KERNELS") == "avx512":
        pytest.skip("this is the AVX512-BF16 run")
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(tests / "test_kernels.py"), str(tests / "test_tree.py")],
        env={**os.environ, "VERISPEC_KERNELS": "avx512"}, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_torch_path_keeps_speculative_greedy_exact_in_bf16(tokenizer, monkeypatch):
    """With the kernels off (VERISPEC_KERNELS=0, or a CPU without AMX) the PyTorch path runs,
    and speculative greedy still equals plain greedy."""
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    model = tiny_llama(len(tokenizer), seed=8, dtype=torch.float32)
    runner = NativeRunner(NativeLlama.from_hf(model, torch.bfloat16))
    assert runner.describe() == "native bfloat16"
    plain = SpeculativeDecoder(model, tokenizer, None, runtime=runner)
    spec = SpeculativeDecoder(model, tokenizer, NgramDrafter(), k=4, runtime=runner)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = ["the cat sat on the mat and the cat sat on the hat " * 3, "abcabcabc"]
    for prompt in prompts:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [plain.generate(p, params).token_ids for p in prompts]
