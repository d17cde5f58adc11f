"""The one-call decoder pass over GGUF weights (verispec/quant/kernels/forward.h) on every kernel
path this CPU runs: close to the PyTorch layer loop over the same products, a position's logits
the same bits whatever the pass holds (1..40 positions, a prompt or a verification pass, a tree
node or the chain to it, another row beside it) and with 1 or 2 threads, and greedy speculative
output equal to plain greedy."""

from __future__ import annotations

import pytest
import torch
from test_gguf import K_LAYER_TYPES, write_tiny_gguf

from verispec import SamplingParams, SpeculativeDecoder
from verispec.drafters.drafter import ChainCut
from verispec.drafters.model import ModelDrafter, propose_together
from verispec.quant import quant_kernels
from verispec.quant.gguf import read
from verispec.quant.quantized_model import GGUFModel
from verispec.runtime.native import gguf_model
from verispec.runtime.native.cache import TreeLinks
from verispec.runtime.native.llama import RowPass
from verispec.runtime.native.native_runner import MAX_CHAIN_UNREAD, NativeRunner

IDS = torch.randint(0, 94, (48,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=["32-value blocks", "K-types"])
def tiny_file(tmp_path_factory, request):
    """Head width 16 (32-value types) and 64 (Q4_K / Q6_K, the types of Q4_K_M files)."""
    folder = tmp_path_factory.mktemp("forward")
    if request.param == "K-types":
        path = folder / "tiny-k-types.gguf"
        write_tiny_gguf(path, hidden=256, ffn=512, layer_types=K_LAYER_TYPES)
    else:
        path = folder / "tiny.gguf"
        write_tiny_gguf(path)
    return path


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def path(request, monkeypatch):
    """The kernel path the process runs, forced for one test (built on first use)."""
    name = request.param
    if not quant_kernels.RUNS_HERE[name]():
        pytest.skip(f"this CPU cannot run the {name} path")
    module = quant_kernels.load(name)
    if module is None:
        pytest.skip(f"the {name} kernels could not be built here")
    monkeypatch.setattr(quant_kernels, "_active", lambda: (name, module))
    return name


def native(file, fused: bool = True):
    """A fresh GGUFLlama over the file: the one-call pass, or (fused False) the PyTorch loop
    over the same products."""
    model = GGUFModel(read(file))
    if fused:
        llama = gguf_model.native_from_gguf(model)
        assert llama.fused is not None and "one C++ call a pass" in llama.describe()
        return llama
    compiled = gguf_model.compiled
    gguf_model.compiled = lambda: None
    try:
        llama = gguf_model.native_from_gguf(model)
    finally:
        gguf_model.compiled = compiled
    assert llama.fused is None
    return llama


def logits_in_passes(llama, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every position's logits, the positions fed in passes of `sizes` -> [T, V]."""
    cache, start, out = llama.new_cache(), 0, []
    for size in sizes:
        out.append(llama.forward(ids[start:start + size], start, size, cache))
        start += size
    assert start == len(ids)
    return torch.cat(out)


def test_the_pass_is_close_to_the_pytorch_loop(tiny_file, path):
    """Both multiply the same int8 codes; norms, rotary, softmax and SiLU round differently in
    the last bits, which can move an activation code by one: measured 4e-7 (32-value types) and
    0.17% (K-types) of the largest logit over 48 positions on AVX-512, the same top token at
    every position; a pass one position off is 32-34% away."""
    got = logits_in_passes(native(tiny_file), IDS, [len(IDS)])
    expected = logits_in_passes(native(tiny_file, fused=False), IDS, [len(IDS)])
    assert (got - expected).abs().max() <= 0.01 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    # the bound has teeth: a pass one position off (rotary) breaks it
    shifted = logits_in_passes(native(tiny_file), torch.cat([IDS[:1], IDS]), [len(IDS) + 1])
    assert (shifted[1:] - expected).abs().max() > 0.01 * expected.abs().max()


def test_the_head_runs_in_the_pass(tiny_file, path):
    """The final norm and head of the wanted positions run in the pass's own call: their
    logits are the head's over the normed last hidden states (the cache's features), as the
    PyTorch head computes them up to the norm's rounding (which can move an activation code by
    one), and a position's neighbour's are far from them."""
    llama = native(tiny_file)
    assert llama.fused.has_head
    cache = llama.new_cache()
    logits = llama.forward(IDS[:40], 0, 16, cache)  # [16, V]: positions 24..39
    features = cache.features[24:40]

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return llama.lm_head(llama._norm(hidden, llama.final_norm)).float()

    expected = head(features)
    assert (logits - expected).abs().max() <= 0.01 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert (logits - head(cache.features[23:39])).abs().max() > 0.01 * expected.abs().max()
    # a wanted position outside the pass is refused before the threads start
    rows = llama.kernels.PassRows(keys=[cache.keys], values=[cache.values], starts=[40],
                                  lengths=[1], tree_bases=[], path_slots=[], path_offsets=[0])
    with pytest.raises(RuntimeError, match="wanted position out of the pass"):
        llama.kernels.forward_layers(torch.zeros(1, llama.shape.hidden_size),
                                     decoder=llama.fused, rows=rows, taps=torch.empty(0),
                                     tap_layers=[], wanted=[1],
                                     logits=torch.empty(1, llama.lm_head.out_features))


def test_a_greedy_chain_is_the_passes_and_their_argmax(tiny_file, path):
    """NativeRunner.greedy_chain (embedding, layers, head and argmax a step, in one C++ call)
    leaves the cache, features and chain that passes and their argmax give, with each token's
    cumulative softmax probability; it declines, changing nothing, where the cache does not
    hold all of the history but its last token."""
    chained, passed = NativeRunner(native(tiny_file)), NativeRunner(native(tiny_file))
    chained.logits(IDS[:30], 1)
    tokens, cumulative = chained.greedy_chain(IDS[:31], 5)
    ids, want, product = IDS[:31], [], 1.0
    passed.logits(IDS[:30], 1)
    for _ in range(5):
        logits = passed.logits(ids, 1)[0]
        want.append(int(logits.argmax()))
        product *= float(torch.softmax(logits.double(), -1).max())
        assert cumulative[len(want) - 1] == pytest.approx(product, rel=1e-5)
        ids = torch.cat([ids, torch.tensor(want[-1:])])
    assert tokens == want and chained.cached_length == 35
    assert torch.equal(chained.cache.features[:35], passed.cache.features[:35])
    assert torch.equal(chained.logits(ids, 1), passed.logits(ids, 1))  # the same cache
    # declined: a history of which nothing is cached, or more than MAX_CHAIN_UNREAD past it
    other = ids.clone()
    other[0] = (other[0] + 1) % 94
    for history in (other, torch.cat([ids, IDS[:MAX_CHAIN_UNREAD + 1]])):
        assert chained.greedy_chain(history, 3) is None and chained.cached_length == 36


def test_a_greedy_chain_reads_what_its_cache_lacks_in_its_first_pass(tiny_file, path):
    """A draft that lags by two tokens (a round that accepted every draft token), or whose
    cache holds a rejected token past the history, chains from there in one call: the same
    tokens, features and cache as passes over the same positions and their argmax."""
    for cached, history in ((IDS[:30], IDS[:32]), (IDS[:31], torch.cat([IDS[:29], IDS[40:42]]))):
        chained, passed = NativeRunner(native(tiny_file)), NativeRunner(native(tiny_file))
        chained.logits(cached, 1)
        passed.logits(cached, 1)
        tokens, _ = chained.greedy_chain(history, 4)
        ids, want = history, []
        for _ in range(4):
            want.append(int(passed.logits(ids, 1)[0].argmax()))
            ids = torch.cat([ids, torch.tensor(want[-1:])])
        assert tokens == want and chained.cached_length == len(history) + 3
        assert torch.equal(chained.cache.features[:len(ids) - 1],
                           passed.cache.features[:len(ids) - 1])
        assert torch.equal(chained.logits(ids, 1), passed.logits(ids, 1))


def test_a_draft_chain_is_cut_where_chain_cut_says(tiny_file, path):
    """The chain in one call stops where ChainCut stops the step-by-step loop, for prices from
    free (never cut: all 8 tokens) to dear, and proposes the same tokens."""
    runner = NativeRunner(native(tiny_file))
    drafter, chains = ModelDrafter(runner, runner.vocab_size), []
    chain = runner.greedy_chain
    runner.greedy_chain = lambda *args: chains.append(chain(*args)) or chains[-1]
    lengths = set()
    flat, gentle = (1.0,) * 9, tuple(1.0 + 0.001 * j for j in range(9))
    steep = (1.0, 1.02, 1.05, 1.1, 1.3, 1.5, 1.9, 2.0, 2.4)
    for c, curve in ((0.0, flat), (0.0, gentle), (0.002, gentle), (0.05, steep), (0.5, steep),
                     (3.0, steep)):
        cut = ChainCut(c, curve)
        drafter.reset()
        fast = propose_together([drafter], [IDS[:30]], [8], [SamplingParams()], [None], [cut])
        runner.greedy_chain = lambda *args: None
        drafter.reset()
        slow = propose_together([drafter], [IDS[:30]], [8], [SamplingParams()], [None], [cut])
        runner.greedy_chain = lambda *args: chains.append(chain(*args)) or chains[-1]
        assert torch.equal(fast[0].tokens, slow[0].tokens), (c, curve)
        lengths.add(len(fast[0].tokens))
    # (a proposal's first step feeds the history: generic; the chain takes the rest)
    assert sum(result is not None for result in chains) >= 3
    assert len(lengths) > 1 and 8 in lengths  # the cuts moved the chain's end


def test_a_positions_bits_do_not_depend_on_the_pass(tiny_file, path):
    llama = native(tiny_file)
    whole = logits_in_passes(llama, IDS[:40], [40])  # one prompt pass
    for sizes in ([1] * 40, [3, 1, 16, 20], [17, 23], [39, 1], list(range(1, 9)) + [4]):
        assert torch.equal(logits_in_passes(llama, IDS[:40], sizes), whole), sizes
    # another row in the same pass, at other positions, changes nothing
    other = llama.new_cache()
    llama.forward(IDS[:10], 0, 1, other)
    cache = llama.new_cache()
    llama.forward(IDS[:30], 0, 1, cache)
    rows = llama.forward_rows([RowPass(cache, IDS[30:40], 30, 10),
                               RowPass(other, IDS[10:13], 10, 3)])
    assert torch.equal(rows[0], whole[30:40])
    assert torch.equal(rows[1], logits_in_passes(llama, IDS[:13], [13])[10:13])


def test_one_two_and_three_threads_give_the_same_bits(tiny_file, path):
    # threads share a product's units unevenly (one that finishes early takes the others'),
    # and split a lone position's SwiGLU: neither may change a bit
    llama = native(tiny_file)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = logits_in_passes(llama, IDS, [20, 1, 27])
        torch.set_num_threads(2)
        two = logits_in_passes(llama, IDS, [20, 1, 27])
        torch.set_num_threads(3)
        three = logits_in_passes(llama, IDS, [1, 1, 20, 26])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, two)
    assert torch.equal(alone, three)


def test_a_tree_node_gets_the_chain_bits(tiny_file, path):
    llama = native(tiny_file)
    prefix = 30
    chain = logits_in_passes(llama, IDS[:prefix + 3], [prefix + 3])[prefix - 1:]  # [4, V]
    # the continuation IDS[p], IDS[p+1], IDS[p+2] at scattered slots among siblings
    cache = llama.new_cache()
    llama.forward(IDS[:prefix - 1], 0, 1, cache)
    other = (IDS[prefix:prefix + 3] + 1) % 94
    tokens = torch.stack([IDS[prefix - 1], other[0], IDS[prefix], other[1], other[2],
                          IDS[prefix + 1], IDS[prefix + 2]])
    base = prefix
    tree = TreeLinks(base, torch.tensor([base - 1, base - 1, base, base + 1, base + 1,
                                         base + 4]))
    logits = llama.forward_rows([RowPass(cache, tokens, prefix - 1, 7, tree)])[0]  # [7, V]
    assert torch.equal(logits[[0, 2, 5, 6]], chain)
    assert not torch.equal(logits[1], chain[1])  # a sibling is not the chain's node


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory, tiny_file):
    """A draft model for the tiny target: the same shape and vocabulary, other random weights
    (it proposes tokens the target often rejects)."""
    path = tmp_path_factory.mktemp("draft") / f"draft-{tiny_file.name}"
    hidden = 256 if "k-types" in tiny_file.name else None
    if hidden:
        write_tiny_gguf(path, seed=1, hidden=256, ffn=512, layer_types=K_LAYER_TYPES)
    else:
        write_tiny_gguf(path, seed=1)
    return path


@pytest.mark.parametrize("drafter", ["ngram", "draft model", "hybrid"])
def test_speculative_greedy_equals_plain_greedy(tiny_file, draft_file, path, drafter):
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 4, 8]  # repeats: n-grams propose
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeDecoder.from_pretrained(tiny_file, draft=None, dequantize=None)
    assert "one C++ call a pass" in plain.target.describe()
    expected = plain.generate(prompt, params)
    draft = {"ngram": "ngram", "draft model": draft_file,
             "hybrid": f"hybrid:{draft_file}"}[drafter]
    spec = SpeculativeDecoder.from_pretrained(tiny_file, draft=draft, k=4, dequantize=None)
    output = spec.generate(prompt, params)
    assert output.token_ids == expected.token_ids
    assert output.stats.checked > 0


def test_bad_rows_are_refused_before_the_threads_start(tiny_file, path):
    llama = native(tiny_file)
    cache = llama.new_cache()
    cache.reserve(8)
    x = torch.zeros(3, llama.shape.hidden_size)
    module = llama.kernels
    rows = module.PassRows(keys=[cache.keys], values=[cache.values], starts=[0], lengths=[2],
                           tree_bases=[], path_slots=[], path_offsets=[0])
    with pytest.raises(RuntimeError, match="rows hold 2 positions, x 3"):
        module.forward_layers(x, decoder=llama.fused, rows=rows, taps=torch.empty(0),
                              tap_layers=[])
    rows = module.PassRows(keys=[cache.keys], values=[cache.values], starts=[0],
                           lengths=[cache.keys.shape[2] + 1], tree_bases=[], path_slots=[],
                           path_offsets=[0])
    with pytest.raises(RuntimeError, match="cache too short"):
        module.forward_layers(torch.zeros(cache.keys.shape[2] + 1, llama.shape.hidden_size),
                              decoder=llama.fused, rows=rows, taps=torch.empty(0), tap_layers=[])


def test_the_avx2_and_avx512_passes_give_the_same_bits(tiny_file, monkeypatch):
    """Both vector paths multiply in the same orders (panels or dot.h's) and run the same float
    operations around them (vector.h; the AVX2 attention on 256-bit halves in lane_sum's
    order), so a prompt pass gives the same logits on either."""
    modules = {name: quant_kernels.load(name) for name in ("avx2", "avx512")
               if quant_kernels.RUNS_HERE[name]()}
    if len(modules) < 2 or None in modules.values():
        pytest.skip("this CPU does not run both vector paths")
    logits = {}
    for name, module in modules.items():
        monkeypatch.setattr(quant_kernels, "_active", lambda n=name, m=module: (n, m))
        logits[name] = logits_in_passes(native(tiny_file), IDS, [len(IDS)])
    assert torch.equal(logits["avx2"], logits["avx512"])
