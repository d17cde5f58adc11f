"""Quantized GGUF files at their own bit width: the reader, exact dequantisation per type, tiny
models written here with gguf's writer and quantizers (run against transformers' own GGUF
loading), errors for bad files, and SmolLM2's Q4_1 file end to end."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from verispec import SamplingParams, SpeculativeDecoder, cpu, loading
from verispec.quant import fallback, linear
from verispec.quant.gguf import GGUFError, read
from verispec.quant.linear import QuantMatrix
from verispec.quant.quantized_model import GGUFModel, qk_order
from verispec.runtime import make_runner
from verispec.runtime.native.gguf_model import gguf_runner

Q = GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, CONTEXT = 64, 128, 4, 2, 96, 256
# One block type per tensor role, so that one tiny model exercises every type the tests write.
LAYER_TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
               "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}
BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # gguf can quantize these
# A model of the K-types real files use most (Q4_K_M: Q4_K and Q6_K), wide enough for their
# 256-value blocks: where the AVX2 or AVX-512 kernels run, its layers run as panels of 16 rows
# (panels.h).
K_LAYER_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
                 "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf only dequantizes these: random blocks
FP16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # where each block's fp16 scales sit


@pytest.fixture(params=["fallback", "kernels"])
def products(request, monkeypatch):
    """Run a test on PyTorch's products and on verispec.quant.quant_kernels (skipped where not
    built)."""
    if request.param == "fallback":
        monkeypatch.setattr(linear, "kernels", lambda: None)
    elif linear.kernels() is None:
        pytest.skip("verispec.quant.quant_kernels is not built here")
    return request.param


def write_tiny_gguf(path, architecture: str = "llama", seed: int = 0,
                    odd_type: GGMLQuantizationType | None = None,
                    tokenizer: bool = False, hidden: int = HIDDEN, ffn: int = FFN,
                    layer_types: dict = LAYER_TYPES) -> dict[str, np.ndarray]:
    """A 2-layer model of hidden width 64 with the types of LAYER_TYPES (odd_type: attn_output
    stored in that type instead, as random blocks), F32 norms, no tokenizer (tokenizer: one
    token per character of 94 bytes, then <s> and </s>). -> the float32 values of every tensor
    as written (dequantised)."""
    HIDDEN, FFN, LAYER_TYPES = hidden, ffn, layer_types  # noqa: N806 - the module's names
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    if tokenizer:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([*list(bytes_to_unicode().values())[:VOCAB - 2], "<s>", "</s>"])
        writer.add_token_merges([])
        writer.add_token_scores([0.0] * VOCAB)
        writer.add_token_types([1] * (VOCAB - 2) + [3, 3])
        writer.add_bos_token_id(VOCAB - 2)
        writer.add_eos_token_id(VOCAB - 1)
    writer.add_block_count(2)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    values = {}

    def add(name: str, shape: tuple[int, int] | tuple[int], qtype: GGMLQuantizationType,
            scale: float = 0.3, offset: float = 0.0) -> None:
        dense = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, dense)
            values[name] = dense
            return
        blocks = random_blocks(rng, qtype, shape) if qtype not in BLOCK_TYPES \
            else gguf_quantize(dense, qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        values[name] = gguf_dequantize(blocks, qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0, 1.0)
    add("output.weight", (VOCAB, HIDDEN), Q.Q4_0)
    add("output_norm.weight", (HIDDEN,), Q.F32, 0.1, 1.0)
    widths = {"attn_q": HIDDEN, "attn_k": HIDDEN // HEADS * KV_HEADS,
              "attn_v": HIDDEN // HEADS * KV_HEADS, "attn_output": HIDDEN, "ffn_gate": FFN,
              "ffn_up": FFN, "ffn_down": HIDDEN}
    for layer in range(2):
        for role, qtype in LAYER_TYPES.items():
            inputs = FFN if role == "ffn_down" else HIDDEN
            if role == "attn_output" and odd_type is not None:
                qtype = odd_type
            add(f"blk.{layer}.{role}.weight", (widths[role], inputs), qtype)
        for norm in ("attn_norm", "ffn_norm"):  # near one, as trained norms are
            add(f"blk.{layer}.{norm}.weight", (HIDDEN,), Q.F32, 0.1, 1.0)
        if architecture == "qwen2":  # q/k/v biases
            for role in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{layer}.{role}.bias", (widths[role],), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, shape) -> np.ndarray:
    """Random bytes for `shape` values of qtype, with every fp16 scale a finite small number."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    # K-types multiply d by 6-bit (Q6_K: 8-bit) sub-scales: smaller d keeps weights near 0.3
    top = 0.02 if qtype not in K_TYPES else 0.02 / 32
    for at in FP16_AT.get(qtype, (0,)):
        scales = (rng.uniform(top / 20, top, (len(blocks), 1))).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


@pytest.fixture(scope="module", params=["32-value blocks", "K-types"])
def tiny_file(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    if request.param == "K-types":
        path = path.with_name("tiny-k-types.gguf")
        return path, write_tiny_gguf(path, hidden=256, ffn=512, layer_types=K_LAYER_TYPES)
    return path, write_tiny_gguf(path)


def test_reader_holds_the_file_bytes_gguf_reads(tiny_file):
    path, _ = tiny_file
    mine = read(path)
    theirs = GGUFReader(str(path))
    assert len(mine.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        held = mine.tensors[tensor.name]
        assert held.qtype == tensor.tensor_type
        assert np.array_equal(held.data.numpy().view(np.uint8),
                              np.asarray(tensor.data).view(np.uint8)), tensor.name
    assert mine.architecture == "llama" and mine.quantized and not mine.has_tokenizer


def test_weights_are_views_of_the_file_not_copies(tiny_file):
    """Every tensor's data sits in one mapping of the file: its address less the first
    tensor's is its distance from that tensor in the file."""
    path, _ = tiny_file
    file = read(path)
    offsets = {tensor.name: int(tensor.data_offset) for tensor in GGUFReader(str(path)).tensors}
    first = next(iter(offsets))
    base = file.tensors[first].data.data_ptr()
    for name, offset in offsets.items():
        assert file.tensors[name].data.data_ptr() - base == offset - offsets[first], name


@pytest.mark.parametrize("qtype", BLOCK_TYPES + K_TYPES, ids=lambda t: t.name)
def test_dequantisation_is_exact_per_type(qtype, products):
    rng = np.random.default_rng(int(qtype))
    shape = (48, 512)
    if qtype in BLOCK_TYPES:  # with a few all-zero blocks, whose scale is zero
        dense = (rng.standard_normal(shape) * 2).astype(np.float32)
        dense[3, :64] = 0
        blocks = gguf_quantize(dense, qtype)
    else:
        blocks = random_blocks(rng, qtype, shape)
    expected = gguf_dequantize(blocks, qtype)
    held = torch.from_numpy(blocks)
    assert np.array_equal(fallback.dequantize(held, qtype).numpy(), expected)
    matrix = QuantMatrix(_tensor("w", qtype, shape, held))
    assert np.array_equal(matrix.dequantize().numpy(), expected)
    ids = torch.tensor([5, 0, 47, 5])
    assert np.array_equal(matrix[ids].numpy(), expected[ids.numpy()])


def _tensor(name, qtype, shape, data):
    from verispec.quant.gguf import GGUFTensor

    return GGUFTensor(name, qtype, shape, data)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + K_TYPES, ids=lambda t: t.name)
def test_products_are_row_count_independent(qtype, products):
    """A row's product is the same bits alone and among 1..12 rows, and close to the float32
    product with the dequantised weight (fallback: float32 rounding only; kernels: int8
    activations, an error of at most max|x| / 254 per block times sum |w|)."""
    rng = np.random.default_rng(1)
    weight = random_blocks(rng, qtype, (40, 256)) if qtype in K_TYPES \
        else gguf_quantize(rng.standard_normal((40, 256)).astype(np.float32), qtype)
    layer = linear.QuantLinear(QuantMatrix(_tensor("w", qtype, (40, 256),
                                                   torch.from_numpy(weight))))
    x = torch.from_numpy(rng.standard_normal((12, 256)).astype(np.float32))
    together = layer(x)
    for count in range(1, 13):
        assert torch.equal(layer(x[:count]), together[:count])
    assert torch.equal(layer(x[7:8]), together[7:8])
    dense = torch.from_numpy(gguf_dequantize(weight, qtype))
    exact = x.double() @ dense.double().T
    bound = (x.abs().amax() / 254 * dense.abs().sum(1)).double() * 1.01 + 1e-4
    assert bool(((together.double() - exact).abs() <= bound).all())


def test_tiny_model_matches_transformers_gguf_loading(tiny_file, products):
    """Logits of the native runtime on the file's blocks against transformers' own loading of
    the same file (dequantised, float32; it also undoes llama's interleaved q/k rows)."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_file
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    runner = gguf_runner(GGUFModel(read(path)))
    ids = torch.tensor([3, 17, 17, 40, 2, 95, 61, 8, 8, 8, 33, 0])
    got = runner.logits(ids, len(ids))  # [T, V]
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    # fallback: float32 rounding; kernels: int8 activations per block of 32 (5% measured on
    # the 32-value model, 11% on the K-types one: random weights, activations far from smooth;
    # the same on the AVX2 and AVX-512 paths, whose products' bounds test_quant_kernels checks)
    tolerance = 1e-4 if products == "fallback" else 0.2 if "k-types" in path.name else 0.1
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_qk_order_undoes_interleaved_rotary_pairs():
    assert qk_order("llama", 1, 4).tolist() == [0, 2, 1, 3]
    assert qk_order("llama", 2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert qk_order("qwen2", 2, 4) is None


def test_qwen2_file_with_biases_matches_transformers(tmp_path, products):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, architecture="qwen2", seed=3)
    model = GGUFModel(read(path))
    assert model.config.model_type == "qwen2" and model.config.attention_bias
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    ids = torch.tensor([7, 1, 1, 50, 22, 90])
    got = gguf_runner(model).logits(ids, len(ids))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    tolerance = 1e-4 if products == "fallback" else 0.1
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_position_logits_do_not_depend_on_the_pass(tiny_file, products):
    path, _ = tiny_file
    model = GGUFModel(read(path))
    ids = torch.tensor([5, 9, 14, 2, 2, 71, 30, 30, 12, 4])
    whole = gguf_runner(model).logits(ids, 6)  # [6, V]: positions 4..9 in one pass
    runner = gguf_runner(model)
    runner.logits(ids[:4], 1)
    steps = [runner.logits(ids[:end], 1)[0] for end in range(5, 11)]  # one position a pass
    assert torch.equal(torch.stack(steps), whole)
    # a position computed in a prompt pass (more than 16 positions) and again in a short pass
    prompt = torch.arange(3, 27)  # 24 positions
    from_prompt = gguf_runner(model).logits(prompt, 1)
    again = gguf_runner(model)
    again.logits(prompt[:-1], 1)
    assert torch.equal(again.logits(prompt, 1), from_prompt)


def test_speculative_greedy_equals_plain_greedy(tiny_file, products):
    path, _ = tiny_file
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 4, 8]  # repeats: n-grams propose
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeDecoder.from_pretrained(path, draft=None, dequantize=None).generate(
        prompt, params)
    spec = SpeculativeDecoder.from_pretrained(path, draft="ngram", k=4, dequantize=None)
    output = spec.generate(prompt, params)
    assert output.token_ids == plain.token_ids
    assert len(output.token_ids) == 40
    # drafts were verified in passes of several positions (a random model's text seldom
    # repeats, so most are rejected: rollbacks; SmolLM2's test below accepts many)
    assert output.stats.checked > 0


def test_unsupported_type_is_dequantised_with_a_log_line(tmp_path, caplog):
    path = tmp_path / "iq4.gguf"
    values = write_tiny_gguf(path, odd_type=Q.IQ4_NL)
    with caplog.at_level(logging.INFO, logger="verispec"):
        model = GGUFModel(read(path))
        runner = gguf_runner(model)
    assert any("IQ4_NL" in record.getMessage() and "bfloat16" in record.getMessage()
               for record in caplog.records)
    out = runner.model.layers[0].out.weight
    assert out.qtype == Q.BF16
    expected = torch.from_numpy(values["blk.0.attn_output.weight"]).to(torch.bfloat16)
    assert torch.equal(out.data, expected)
    assert runner.logits(torch.tensor([1, 2, 3]), 1).isfinite().all()


def test_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "with-tokenizer.gguf"
    write_tiny_gguf(path, tokenizer=True)
    with caplog.at_level(logging.INFO, logger="verispec"):
        model, first = loading.load(path, dtype="auto", dequantize=None)
        converted = sum("converting the tokenizer" in r.getMessage() for r in caplog.records)
        _, second = loading.load(path, dtype="auto", dequantize=None)
    assert converted == 1  # the first load only
    assert sum("converting the tokenizer" in r.getMessage() for r in caplog.records) == 1
    assert list((tmp_path / "cache" / "verispec" / "tokenizers").iterdir())
    assert first("abc")["input_ids"] == second("abc")["input_ids"] == [64, 65, 66]
    assert model.config.eos_token_id == second.eos_token_id == VOCAB - 1


def test_truncated_files_say_so(tiny_file, tmp_path):
    path, _ = tiny_file
    data = path.read_bytes()
    for cut, message in ((len(data) - 100, "truncated: tensor"),
                         (200, "truncated: its header")):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=message):
            read(short)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read(garbage)
    with pytest.raises(GGUFError, match="cannot map"):
        (tmp_path / "empty.gguf").write_bytes(b"")
        read(tmp_path / "empty.gguf")


def test_unknown_architecture_is_refused_clearly(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, architecture="mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        loading.load(path, dtype="auto", dequantize=None)


def test_other_dtypes_and_runtimes_ask_for_dequantisation(tiny_file):
    path, _ = tiny_file
    model, tokenizer = loading.load(path, dtype="auto", dequantize=None)
    assert isinstance(model, GGUFModel) and tokenizer is None
    for kwargs in ({"runtime": "hf"}, {"int8": True}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="dequantize"):
            make_runner(model, **kwargs)
    with pytest.raises(ValueError, match="dequantize must be"):
        loading.load(path, dtype="auto", dequantize="int4")


# SmolLM2-135M-Instruct Q4_1 (the embedded default: Q4_1 layers, a Q8_0 embedding tied as head)
PROMPT = "Write a Python function that returns the squares of a list of numbers."


@pytest.mark.parametrize("bf16_kernels", [True, False])
def test_auto_weights_follow_the_kernels_that_run_here(monkeypatch, bf16_kernels):
    """dequantize="auto": bfloat16 where the C++ bfloat16 kernels run, the file's own formats
    elsewhere; None and "bf16" as given; off the CPU bfloat16 (no quantised kernels there)."""
    monkeypatch.setattr(cpu, "runs_bf16_kernels", lambda: bf16_kernels)
    monkeypatch.setattr(loading.quant_kernels, "panel_types_here", lambda: frozenset())
    assert loading.weights_for("auto") == ("bf16" if bf16_kernels else None)
    assert loading.weights_for(None) is None and loading.weights_for("bf16") == "bf16"
    assert loading.weights_for("auto", device="cuda") == "bf16"
    with pytest.raises(ValueError, match="dequantize must be"):
        loading.weights_for("int4")


@pytest.fixture(scope="module")
def smollm2():
    try:
        model, tokenizer = loading.load(None, dtype="auto", dequantize=None)
    except loading.ModelNotFoundError as err:
        pytest.skip(str(err))
    return model, tokenizer


def test_smollm2_logits_close_to_the_dequantised_bf16_model(smollm2):
    """Against today's path (transformers' dequantisation, bfloat16 native runtime), over a
    prompt: max |logit difference| at most 15% of the largest logit (measured: 3.6% with the
    kernels, 2.2% with PyTorch products), the top token the same at 85% of positions or more
    (measured 13 of 14, 14 of 14) and always among the bfloat16 model's top 5."""
    model, tokenizer = smollm2
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    quantized = make_runner(model).logits(ids, len(ids))
    hf_model, _ = loading.load(None, dtype="auto", dequantize="bf16")
    bf16 = make_runner(hf_model)
    assert "bfloat16" in bf16.describe()
    expected = bf16.logits(ids, len(ids))
    assert (quantized - expected).abs().max() <= 0.15 * expected.abs().max()
    assert (quantized.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85
    top5 = expected.topk(5, dim=-1).indices  # [T, 5]
    assert bool((top5 == quantized.argmax(-1, keepdim=True)).any(-1).all())


@pytest.mark.parametrize("draft", ["ngram", "default"])
def test_smollm2_speculative_greedy_equals_plain(smollm2, draft):
    model, tokenizer = smollm2
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = SpeculativeDecoder(model, tokenizer, None).generate(PROMPT, params)
    decoder = SpeculativeDecoder.from_pretrained(None, draft=draft, k=4, dequantize=None)
    assert decoder.target.model.lm_head.weight.quantized  # the file's blocks, not bf16
    output = decoder.generate(PROMPT, params)
    assert output.token_ids == plain.token_ids


def test_auto_weights_run_q4_k_m_files_as_they_are_where_panels_run(tiny_file, monkeypatch):
    """A file whose weights are mostly panel types (Q4_K_M) keeps its own bit width where the
    kernels multiply them as panels (the AVX2 and AVX-512 paths), even beside the bfloat16
    kernels; other files do not. On an AVX2-only CPU no bfloat16 kernels run, so every
    quantized file keeps its own bit width there."""
    path, _ = tiny_file
    file = read(path)
    monkeypatch.setattr(cpu, "runs_bf16_kernels", lambda: True)
    panels = "k-types" in path.name  # the 32-value model's Q5_1 (18%) has no panel layout
    monkeypatch.setattr(loading.quant_kernels, "panel_types_here",
                        lambda: loading.quant_kernels.PANEL_TYPES)
    assert loading.weights_for("auto", file=file) == (None if panels else "bf16")
    monkeypatch.setattr(loading.quant_kernels, "panel_types_here", lambda: frozenset())
    assert loading.weights_for("auto", file=file) == "bf16"
    monkeypatch.setattr(cpu, "runs_bf16_kernels", lambda: False)  # an AVX2-only CPU
    assert loading.weights_for("auto", file=file) is None


def test_the_embedded_q4_1_model_runs_as_panels_where_panels_run(monkeypatch):
    """SmolLM2's file (Q4_1 layers, a Q8_0 embedding) is all panel types: "auto" keeps its own
    bit width wherever the AVX2 or AVX-512 kernels run, beside the bfloat16 kernels too."""
    try:
        file = read(loading.embedded_model_file())
    except loading.ModelNotFoundError as err:
        pytest.skip(str(err))
    monkeypatch.setattr(cpu, "runs_bf16_kernels", lambda: True)
    monkeypatch.setattr(loading.quant_kernels, "panel_types_here",
                        lambda: loading.quant_kernels.PANEL_TYPES)
    assert loading.weights_for("auto", file=file) is None
    monkeypatch.setattr(loading.quant_kernels, "panel_types_here", lambda: frozenset())
    assert loading.weights_for("auto", file=file) == "bf16"
