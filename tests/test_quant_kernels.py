"""The quantised-weight kernels (verispec.quant.quant_kernels) on every path this CPU runs
(AVX512-VNNI, AVX2, portable): exact dequantisation against gguf-py, products against an fp32
reference within the bound the int8 activations allow, a row's output the same bits whatever rows
and threads share the call (batch invariance), and the same bits on every path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from verispec.quant import quant_kernels

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}  # gguf-py has quantizers for these
# Where each block keeps its fp16 fields, and its code bytes (the rest: K-type scale bytes).
HALVES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
          T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
CODES = {T.Q4_0: (2, 18), T.Q4_1: (4, 20), T.Q5_0: (2, 22), T.Q5_1: (4, 24), T.Q8_0: (2, 34),
         T.Q4_K: (16, 144), T.Q5_K: (16, 176), T.Q6_K: (0, 192)}
# The paths this CPU runs, known from its flags: nothing is built at collection (`load_path`
# builds on first use and skips a test where a path does not build).
PATHS = [path for path in ("scalar", "avx2", "avx512") if quant_kernels.RUNS_HERE[path]()]


def load_path(path: str):
    """The compiled module of one kernel path, built on first use; skips where it cannot be."""
    module = quant_kernels.load(path)
    if module is None:
        pytest.skip(f"the {path} kernels could not be built here")
    return module


def row_values(qtype) -> int:
    """K for the tests: two K-type super-blocks; 13 blocks of 32 otherwise (8 + a short group)."""
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 13 * 32


def random_blocks(qtype, n: int, k: int, seed: int) -> torch.Tensor:
    """Valid blocks with random codes and scales: every code pattern (Q8_0's -128 included, which
    gguf's quantizer never writes), fp16 fields of either sign, some zero or subnormal."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block_size, block_bytes), dtype=np.uint8)
    for offset in HALVES[qtype]:
        halves = rng.uniform(-1, 1, size=len(blocks)) * 10.0 ** rng.uniform(-4, -1, len(blocks))
        halves[rng.random(len(blocks)) < 0.05] = 0.0
        halves[rng.random(len(blocks)) < 0.05] = 3e-6  # subnormal in fp16
        blocks[:, offset:offset + 2] = halves.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def quantized_blocks(qtype, n: int, k: int, seed: int) -> torch.Tensor:
    """Weights as a GGUF writer makes them (gguf-py's own quantizer)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(reference_quantize(values, qtype))


def weights(qtype, n: int, k: int, seed: int) -> torch.Tensor:
    if qtype in QUANTIZABLE and seed % 2 == 0:
        return quantized_blocks(qtype, n, k, seed)
    return random_blocks(qtype, n, k, seed)


def activations(r: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(r, k, generator=generator)
    x[:, 5] *= 30.0  # an outlier feature, as real activations have: coarse blocks
    return x


def reference(weight: torch.Tensor, qtype) -> torch.Tensor:
    return torch.from_numpy(reference_dequantize(weight.numpy(), qtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# (a) dequantisation ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_bit_for_bit(path, qtype):
    module = load_path(path)
    for seed in (0, 1):
        weight = weights(qtype, 7, row_values(qtype), seed)
        expected = reference(weight, qtype)
        assert torch.equal(bits(module.dequantize(weight, int(qtype))), bits(expected))
        ids = torch.tensor([6, 0, 3, 3], dtype=torch.int64)
        assert torch.equal(bits(module.get_rows(weight, int(qtype), ids)), bits(expected[ids]))


def test_get_rows_keeps_the_ids_shape():
    weight = weights(T.Q4_K, 9, 256, 1)
    rows = quant_kernels.get_rows(weight, T.Q4_K, torch.tensor([[8, 1], [1, 0]]))
    assert rows.shape == (2, 2, 256)
    assert torch.equal(bits(rows[0, 1]), bits(reference(weight, T.Q4_K)[1]))


# (b) products against fp32 -------------------------------------------------------------------


def additive_part(weight: torch.Tensor, qtype) -> torch.Tensor:
    """Each weight's value at code 0 (Q4_0's -8 d, Q4_K's -dmin m, ...): the part of the value
    the kernel carries in float beside the integer products."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    zeroed = weight.clone().reshape(-1, block_bytes)
    first, last = CODES[qtype]
    zeroed[:, first:last] = 0
    if qtype == T.Q6_K:  # its code 0 is stored as 32 (q - 32)
        zeroed[:, 128:192] = 0xAA  # high pairs 2 -> 32 with zero low nibbles
    return reference(zeroed.reshape(weight.shape), qtype)


def error_bound(x: torch.Tensor, weight: torch.Tensor, qtype) -> torch.Tensor:
    """|y - x @ W.T| per output: each activation is off its int8 code by at most d_x / 2
    (d_x = max|x| / 127 over its block of 32), so a block contributes at most d_x / 2 * sum|w|;
    plus fp32 rounding, bounded by 1e-5 of the sum of the magnitudes the kernel adds (the
    integer part, |w - c|, and the additive part c, twice)."""
    w = reference(weight, qtype).double()  # [N, K]
    c = additive_part(weight, qtype).double()
    x = x.double()
    d_x = x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127  # [R, K / 32]
    half_steps = (d_x / 2).repeat_interleave(32, dim=1)  # [R, K]
    quantisation = half_steps @ w.abs().T
    magnitudes = (x.abs() + half_steps) @ ((w - c).abs() + 2 * c.abs()).T
    return quantisation + 1e-5 * magnitudes


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_within_the_activation_bound(path, qtype):
    module = load_path(path)
    k = row_values(qtype)
    for seed in (0, 1):
        weight = weights(qtype, 24, k, seed)
        x = activations(5, k, seed)
        y = module.matmul(x, weight, int(qtype))
        exact = x.double() @ reference(weight, qtype).double().T
        bound = error_bound(x, weight, qtype)
        assert torch.all((y.double() - exact).abs() <= bound), (y.double() - exact).abs().max()
        # the bound means something: well below the outputs' own scale (the outlier block and
        # random block scales of 1e-4 .. 1e-1 put it at 2-8% of sum |x| |w|)
        scale = x.double().abs() @ reference(weight, qtype).double().abs().T
        assert torch.all(bound < 0.1 * scale)


def test_matmul_bound_catches_a_wrong_weight():
    """Negative control: the bound rejects a product with a different weight of the same type."""
    module = load_path(PATHS[0])
    weight, other = weights(T.Q4_K, 24, 512, 1), weights(T.Q4_K, 24, 512, 3)
    x = activations(5, 512, 0)
    y = module.matmul(x, other, int(T.Q4_K))
    exact = x.double() @ reference(weight, T.Q4_K).double().T
    assert not torch.all((y.double() - exact).abs() <= error_bound(x, weight, T.Q4_K))


# (c) batch invariance and the two paths ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_output_does_not_depend_on_the_other_rows_or_threads(path, qtype):
    module = load_path(path)
    k = row_values(qtype)
    weight = weights(qtype, 40, k, 1)
    x = activations(40, k, 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = module.matmul(x, weight, int(qtype))  # [40, 40]
        for rows in range(1, 41):  # rows 0..rows-1 alone: tiles of 16 cut them differently
            assert torch.equal(bits(module.matmul(x[:rows], weight, int(qtype))),
                               bits(together[:rows])), rows
        order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
        assert torch.equal(bits(module.matmul(x[order], weight, int(qtype))),
                           bits(together[order]))
        torch.set_num_threads(1)
        assert torch.equal(bits(module.matmul(x, weight, int(qtype))), bits(together))
    finally:
        torch.set_num_threads(threads)


def documented_activations(x: np.ndarray):
    """activations.h's definition in NumPy, element by element: per block of 32, d = max|x| /
    127 (a NaN wins), q = round(x / d) half to even, clamped to +-127, NaN -> 0; the rows
    padded with zeros to a multiple of 256; sums per 16 (d * sum q), their integer sums, and
    per block d * (sum of both halves)."""
    rows, k = x.shape
    padded = (k + 255) // 256 * 256
    x = np.concatenate([x, np.zeros((rows, padded - k), np.float32)], axis=1)
    blocks = x.reshape(rows, -1, 32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        magnitude = np.abs(blocks)
        amax = np.where(np.isnan(magnitude).any(-1), np.float32(np.nan), np.nanmax(
            np.where(np.isnan(magnitude), 0, magnitude), -1)).astype(np.float32)
        d = (amax / np.float32(127)).astype(np.float32)
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = np.rint(blocks * inverse[..., None]).astype(np.float32)
    v = np.where(np.isnan(v), 0, np.clip(v, -127, 127))
    codes = v.astype(np.int8).reshape(rows, padded)
    b16 = codes.reshape(rows, -1, 16).astype(np.int32).sum(-1)
    with np.errstate(invalid="ignore"):  # a NaN block's d: its sums are NaN
        sums = (np.repeat(d, 2, axis=1) * b16.astype(np.float32)).astype(np.float32)
        s32 = (d * (b16[:, 0::2] + b16[:, 1::2]).astype(np.float32)).astype(np.float32)
    return codes, d, sums, b16, s32


@pytest.mark.parametrize("path", PATHS)
def test_activations_are_quantised_as_documented(path):
    module = load_path(path)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 300)) * 10.0 ** rng.uniform(-3, 3, (6, 1))).astype(np.float32)
    x[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # ties: x / d = x, as d = 127 / 127
    x[0, 0] = 127.0
    x[1, 5] = np.nan  # a NaN block
    x[2, 40], x[2, 77] = np.inf, -np.inf  # an infinite maximum: the block's codes are 0 or NaN
    x[3, 64:96] = np.float32(1e-43)  # subnormal: 1 / d overflows
    x[3, 96:128] = 0.0
    x[4, 128:160] = rng.uniform(-1, 1, 32).astype(np.float32) * np.float32(3e-38)
    x[5] = np.round(x[5] * 2) / 2  # many exact halves
    got = [t.numpy() for t in module.quantize_activations(torch.from_numpy(x))]
    want = documented_activations(x)
    for name, a, b in zip(("codes", "scales", "sums", "b16", "s32"), got, want, strict=True):
        assert np.array_equal(a.view(np.int32 if a.dtype == np.float32 else a.dtype),
                              b.view(np.int32 if b.dtype == np.float32 else b.dtype)) or \
            np.array_equal(a, b, equal_nan=True), name
    # a negative control: rounding half away from zero differs on the ties of row 0
    away = np.trunc(x[0, :32] + np.copysign(0.5, x[0, :32]))
    assert got[1][0, 0] == 1.0 and not np.array_equal(away.astype(np.int8), got[0][0, :32])


@pytest.mark.parametrize("path", PATHS)
def test_greedy_top_is_the_argmax_and_its_probability(path):
    """A greedy draft step's choice and confidence (kernels/greedy.h) against torch's argmax
    and softmax: ties go to the first index, -inf logits weigh nothing, a NaN wins as in
    torch, and a row read with a stride (a cut head) is read where it lies."""
    module = load_path(path)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 1003, generator=generator) * torch.tensor([[0.1], [1], [3], [10], [30],
                                                                     [1]])
    rows[1, 700] = rows[1, 5] = rows[1].max() + 1.0  # a tie: the first index wins
    rows[2, ::3] = float("-inf")
    rows[5] = 0.0  # uniform: probability 1 / 1003
    wide = torch.randn(2, 2000, generator=generator)
    for logits in (rows, wide[:, :1500]):
        index, probability = module.greedy_top(logits)
        assert torch.equal(index, logits.argmax(-1))
        want = torch.softmax(logits.double(), -1).max(-1).values.float()
        torch.testing.assert_close(probability, want, rtol=2e-6, atol=0)
    # a negative control: the second largest's probability is not the top's
    second = torch.softmax(rows[3].double(), -1).sort(descending=True).values[1]
    assert abs(float(module.greedy_top(rows[3:4])[1]) - float(second)) > 1e-3
    broken = rows[:1].clone()
    broken[0, 9] = float("nan")
    index, probability = module.greedy_top(broken)
    assert int(index) == int(broken.argmax(-1)) == 9 and bool(probability.isnan())
    with pytest.raises(RuntimeError, match="float32"):
        module.greedy_top(rows.double())


@pytest.mark.parametrize("path", [p for p in PATHS if p != "scalar"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_path_gives_the_portable_paths_bits(path, qtype):
    k = row_values(qtype)
    for seed in (0, 1):
        weight = weights(qtype, 33, k, seed)
        x = activations(19, k, seed)
        portable, fast = (load_path(p).matmul(x, weight, int(qtype)) for p in ("scalar", path))
        assert torch.equal(bits(portable), bits(fast))


@pytest.mark.parametrize("setting, expected", [("scalar", "scalar"), ("0", "off")] +
                         ([("avx2", "avx2")] if "avx2" in PATHS else []))
def test_the_environment_chooses_the_path(setting, expected):
    code = ("import torch; from verispec.quant import quant_kernels; from gguf import "
            "GGMLQuantizationType as T; print(quant_kernels.path); "
            "w = torch.zeros(3, 144, dtype=torch.uint8); "
            "print(quant_kernels.matmul(torch.ones(2, 256), w, T.Q4_K).shape)")
    env = {**os.environ, "VERISPEC_KERNELS": setting}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == expected and out[1] == "torch.Size([2, 3])"


def test_bfloat16_activations_are_their_float32_values():
    weight = weights(T.Q6_K, 8, 256, 1)
    x = activations(3, 256, 2).to(torch.bfloat16)
    assert torch.equal(bits(quant_kernels.matmul(x, weight, T.Q6_K)),
                       bits(quant_kernels.matmul(x.float(), weight, T.Q6_K)))


def test_leading_dimensions_are_kept():
    weight = weights(T.Q8_0, 8, 64, 0)
    x = activations(6, 64, 2)
    y = quant_kernels.matmul(x.reshape(2, 3, 64), weight, T.Q8_0)
    assert y.shape == (2, 3, 8) and torch.equal(bits(y.reshape(6, 8)),
                                                bits(quant_kernels.matmul(x, weight, T.Q8_0)))


# (e) bad input -------------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_clear_message():
    weight = weights(T.Q4_K, 4, 256, 1)  # rows of 144 bytes: K = 256
    x = activations(2, 256, 0)
    with pytest.raises(ValueError, match="not whole blocks"):
        quant_kernels.matmul(x, weight[:, :100].contiguous(), T.Q4_K)
    with pytest.raises(ValueError, match="has no quantised kernel"):
        quant_kernels.matmul(x, weight, T.Q2_K)
    with pytest.raises(ValueError, match="has no quantised kernel"):
        quant_kernels.dequantize(weight, 99)
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        quant_kernels.matmul(activations(2, 100, 0), weight, T.Q4_K)
    with pytest.raises(ValueError, match="K = 512 features but the Q4_K weight's rows hold 256"):
        quant_kernels.matmul(activations(2, 512, 0), weight, T.Q4_K)
    with pytest.raises(ValueError, match="uint8 tensor"):
        quant_kernels.matmul(x, weight.to(torch.int16), T.Q4_K)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_kernels.matmul(x.to(torch.int32), weight, T.Q4_K)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\)"):
        quant_kernels.get_rows(weight, T.Q4_K, torch.tensor([0, 4]))


# (d) panels: weights repacked by 16 rows, multiplied 16 outputs at a time (panels.h) -----------

PANEL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def panel_shapes(qtype) -> list[tuple[int, int]]:
    """[N, K] cases: K-types by 256, the others by 32 (896 = 28 blocks, as Qwen2.5-0.5B's)."""
    if GGML_QUANT_SIZES[qtype][0] == 256:
        return [(48, 512), (16, 256), (32, 1536)]
    return [(48, 416), (16, 32), (32, 896)]
PANEL_PATHS = [p for p in PATHS if p != "scalar"]  # the vector paths multiply panels


def panel_module(path: str, qtype):
    """The path's module, which must list `qtype` among its panel types (pack holds only those)."""
    module = load_path(path)
    assert int(qtype) in module.panel_types(), f"{path} has no panel kernel for {qtype.name}"
    return module


def test_the_vector_paths_multiply_every_panel_type_as_panels():
    """Both vector paths have a panel kernel for every type with a panel layout, the portable
    path none; panel_types_here() says so from the CPU's flags without building."""
    for path in PATHS:
        expected = [] if path == "scalar" else sorted(PANEL_TYPES)
        assert sorted(load_path(path).panel_types()) == expected, path
    assert frozenset(PANEL_TYPES) == quant_kernels.PANEL_TYPES
    assert quant_kernels.panel_types_here() == quant_kernels.panel_types()


@pytest.mark.parametrize("setting, runs", [("1", True), ("avx512", True), ("avx2", True),
                                           ("scalar", False), ("0", False)])
def test_panel_types_here_follow_the_kernel_setting(monkeypatch, setting, runs):
    """Panels wherever a vector path may run on an AVX2 CPU; none on the portable path, with the
    kernels off, or on a CPU without AVX2."""
    monkeypatch.setenv("VERISPEC_KERNELS", setting)
    monkeypatch.setattr(quant_kernels.cpu, "has_avx2", lambda: True)
    assert quant_kernels.panel_types_here() == (quant_kernels.PANEL_TYPES if runs else frozenset())
    monkeypatch.setattr(quant_kernels.cpu, "has_avx2", lambda: False)  # neither vector path runs
    assert quant_kernels.panel_types_here() == frozenset()


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_panel_order_reference_is_within_the_activation_bound(qtype):
    """The plain C++ reference of the panel order (every path has it) against float64."""
    module = load_path(PATHS[0])
    for seed, (n, k) in enumerate(panel_shapes(qtype)[::2]):
        weight = weights(qtype, n, k, seed)
        x = activations(5, k, seed)
        y = module.matmul_panels_reference(x, weight, int(qtype))
        exact = x.double() @ reference(weight, qtype).double().T
        assert torch.all((y.double() - exact).abs() <= error_bound(x, weight, qtype))


@pytest.mark.skipif(not PANEL_PATHS, reason="no kernel path with panels runs on this CPU")
@pytest.mark.parametrize("path", PANEL_PATHS)
@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_packed_products_are_the_panel_orders_bits(path, qtype):
    """Packing and the kernel together give the reference's bits, from the file's blocks."""
    module = panel_module(path, qtype)
    for seed, (n, k) in enumerate(panel_shapes(qtype)):
        weight = weights(qtype, n, k, seed)
        x = activations(19, k, seed)
        packed = module.pack(weight, int(qtype))
        assert packed.shape[0] == n // 16
        assert torch.equal(bits(module.matmul_panels(x, packed, int(qtype), k)),
                           bits(module.matmul_panels_reference(x, weight, int(qtype))))


def test_panel_bits_catch_a_wrong_code():
    """The bit comparison above fails where one code of one weight differs."""
    if not PANEL_PATHS:
        pytest.skip("no kernel path with panels runs on this CPU")
    module = panel_module(PANEL_PATHS[-1], T.Q4_1)
    weight = weights(T.Q4_1, 16, 64, 1)
    x = activations(3, 64, 1)
    wrong = weight.clone()
    wrong[5, 4] ^= 1  # the first nibble byte of row 5: its element 0's code
    assert not torch.equal(bits(module.matmul_panels(x, module.pack(wrong, int(T.Q4_1)),
                                                     int(T.Q4_1), 64)),
                           bits(module.matmul_panels_reference(x, weight, int(T.Q4_1))))


@pytest.mark.skipif(not PANEL_PATHS, reason="no kernel path with panels runs on this CPU")
@pytest.mark.parametrize("path", PANEL_PATHS)
@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_a_rows_packed_output_does_not_depend_on_the_other_rows_or_threads(path, qtype):
    module = panel_module(path, qtype)
    n, k = panel_shapes(qtype)[0]
    weight = weights(qtype, n, k, 1)
    packed = module.pack(weight, int(qtype))
    x = activations(40, k, 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = module.matmul_panels(x, packed, int(qtype), k)  # [40, n]
        for rows in range(1, 41):  # tiles of 8 cut them differently; 1-8 are unrolled
            assert torch.equal(bits(module.matmul_panels(x[:rows], packed, int(qtype), k)),
                               bits(together[:rows])), rows
        torch.set_num_threads(1)
        assert torch.equal(bits(module.matmul_panels(x, packed, int(qtype), k)),
                           bits(together))
    finally:
        torch.set_num_threads(threads)


def test_panels_refuse_what_they_cannot_hold():
    if not quant_kernels.panel_types():
        pytest.skip("the active path multiplies no type as panels")
    with pytest.raises(ValueError, match="no panel layout"):
        quant_kernels.pack(weights(T.Q4_K, 24, 256, 1), T.Q4_K)  # 24 rows: not whole panels
    with pytest.raises(ValueError, match="no panel layout"):
        quant_kernels.pack(weights(T.Q5_1, 16, 256, 1), T.Q5_1)
