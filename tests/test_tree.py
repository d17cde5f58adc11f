"""Token trees in the native runtime: a tree node gets the very bits the chain to it gets, on the
C++ kernels (both attention paths) and the PyTorch path (bfloat16 grouped, float32 one by one),
so greedy tree verification keeps output equal to plain decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.drafters.drafter import Draft
from verispec.runtime.native import NativeLlama, NativeRunner, batched_logits, bf16_kernels
from verispec.runtime.native.cache import TreeLinks
from verispec.runtime.native.llama import RowPass

IDS = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(5))


def tiny(head_dim: int, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1)
    return LlamaForCausalLM(config).to(dtype).eval()


PATHS = {  # runtime -> (head_dim, dtype, kernels on)
    "kernels-amx": (64, torch.bfloat16, True),
    "kernels-avx512": (16, torch.bfloat16, True),
    "torch-bf16": (32, torch.bfloat16, False),
    # float32 linear layers round differently by row count (chains too): equal to rounding
    "torch-fp32": (32, torch.float32, False),
}


@pytest.fixture(params=list(PATHS))
def native(request, monkeypatch):
    head_dim, dtype, use_kernels = PATHS[request.param]
    if use_kernels and bf16_kernels.load() is None:
        pytest.skip("verispec's C++ kernels do not run here")
    monkeypatch.setenv("VERISPEC_KERNELS", "1" if use_kernels else "0")
    model = NativeLlama.from_hf(tiny(head_dim, dtype))
    assert (model.fused is not None) == use_kernels
    return model


@pytest.mark.parametrize("prefix", [39, 62, 64])  # the tree's first slot inside, at a block's end
def test_a_tree_node_gets_the_chain_bits(native, prefix):
    chain = NativeRunner(native)
    chain.logits(IDS[:prefix - 1], 1)
    expected = torch.cat([chain.logits(IDS[:n], 1) for n in range(prefix, prefix + 4)])  # [4, V]
    # A tree under the last prefix token: the true continuation IDS[p], IDS[p+1], IDS[p+2] at
    # scattered slots, between siblings and cousins that are not on its path.
    cache = native.new_cache()
    native.forward_rows([RowPass(cache, IDS[:prefix - 1], 0, 1)])
    other = (IDS[prefix:prefix + 3] + 1) % 96
    base = prefix
    tokens = torch.stack([IDS[prefix - 1], other[0], IDS[prefix], other[1], other[2],
                          IDS[prefix + 1], IDS[prefix + 2]])
    parents = torch.tensor([base - 1, base - 1, base, base + 1, base + 1, base + 4],
                           dtype=torch.long)
    tree = TreeLinks(base, parents)
    logits = native.forward_rows([RowPass(cache, tokens, prefix - 1, 7, tree)])[0]  # [7, V]
    assert tree.path(base + 5) == [base + 1, base + 4, base + 5]
    on_path = logits[[0, 2, 5, 6]]  # root, then the true continuation's nodes
    if native.dtype == torch.float32:
        torch.testing.assert_close(on_path, expected, rtol=0, atol=1e-4)
        return
    assert torch.equal(on_path, expected)
    assert not torch.equal(logits[1], expected[1])  # a sibling is not the chain's node
    # A tree pass next to a chain row in one batch gives the same bits.
    chain_cache = native.new_cache()
    native.forward_rows([RowPass(chain_cache, IDS[:50], 0, 1)])
    cache2 = native.new_cache()
    native.forward_rows([RowPass(cache2, IDS[:prefix - 1], 0, 1)])
    together = native.forward_rows([RowPass(cache2, tokens, prefix - 1, 7, tree),
                                    RowPass(chain_cache, IDS[50:53], 50, 3)])
    assert torch.equal(together[0], logits)


def test_tree_links_refuse_a_node_off_the_root():
    tree = TreeLinks(10, torch.tensor([9, 7]))
    assert tree.path(10) == [10]
    with pytest.raises(ValueError, match="root"):
        tree.path(11)


def test_the_accepted_path_is_kept_in_place_and_the_rest_falls_out(native):
    """runner.logits over a tree, then over history + the path the target followed: the path's
    keys were moved into place, so the next pass's logits are the plain runner's."""
    plain = NativeRunner(native)
    plain.logits(IDS[:59], 1)
    expected = plain.logits(IDS[:65], 2)  # after positions 63 and 64
    runner = NativeRunner(native)
    runner.logits(IDS[:59], 1)  # a prompt pass; the tree's root (IDS[59]) comes with the tree
    wrong = (IDS[60:63] + 7) % 96
    tokens = torch.stack([wrong[0], IDS[60], wrong[1], IDS[61], IDS[62], wrong[2]])
    parents = torch.tensor([-1, -1, 1, 1, 3, 4])  # path IDS[60] (1), IDS[61] (3), IDS[62] (4)
    runner.logits(torch.cat([IDS[:60], tokens]), 7, parents)
    assert runner.cached_length == 60  # the history; the tree waits
    runner.settle(IDS[:64])
    assert runner.cached_ids.tolist() == IDS[:63].tolist()  # the path, in place
    got = runner.logits(IDS[:65], 2)
    if native.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    else:
        assert torch.equal(got, expected)
    # A tree none of whose nodes the next ids follow leaves the history alone.
    runner.logits(torch.cat([IDS[:65], tokens[:2]]), 3, torch.tensor([-1, 0]))
    runner.logits(IDS[:66], 1)
    assert runner.cached_length == 66


def test_tree_passes_check_their_links(native):
    runner = NativeRunner(native)
    with pytest.raises(ValueError, match="parent"):
        runner.logits(IDS[:12], 3, torch.tensor([-1, 1]))  # a parent after its child
    with pytest.raises(ValueError, match="parents"):
        runner.logits(IDS[:12], 3, torch.tensor([-1]))
    with pytest.raises(ValueError, match="at most"):
        batched_logits([runner], [IDS[:40]], [17], [torch.full((16,), -1)])


def test_a_tree_draft_truncates_by_depth():
    draft = Draft(torch.tensor([5, 6, 7, 8, 9]), None, 0, torch.tensor([-1, -1, 0, 1, 2]))
    assert draft.depths == [1, 1, 2, 2, 3] and draft.depth == 3
    cut = draft.truncated(2)
    assert cut.tokens.tolist() == [5, 6, 7, 8] and cut.parents.tolist() == [-1, -1, 0, 1]
    assert draft.truncated(0).tokens.numel() == 0
    chain = Draft(torch.tensor([1, 2, 3]), None)
    assert chain.depth == 3 and chain.truncated(1).tokens.tolist() == [1]


def test_a_tree_keeps_its_likeliest_tokens_with_their_ancestors():
    # 0 (-0.1) -> 2 (-0.3) -> 4 (-0.35); 1 (-2.0) -> 3 (-2.5)
    draft = Draft(torch.tensor([5, 6, 7, 8, 9]), None, 0, torch.tensor([-1, -1, 0, 1, 2]),
                  torch.tensor([-0.1, -2.0, -0.3, -2.5, -0.35]))
    kept = draft.pruned(3)
    assert kept.tokens.tolist() == [5, 7, 9] and kept.parents.tolist() == [-1, 0, 1]
    assert kept.scores.tolist() == pytest.approx([-0.1, -0.3, -0.35])
    kept = draft.pruned(4)
    assert kept.tokens.tolist() == [5, 6, 7, 9] and kept.parents.tolist() == [-1, -1, 0, 2]
    assert draft.pruned(0).tokens.numel() == 0 and draft.pruned(9) is draft
    # a tie between a parent and its child keeps the parent first
    tied = Draft(torch.tensor([1, 2]), None, 0, torch.tensor([-1, 0]), torch.tensor([-1.0, -1.0]))
    assert tied.pruned(1).tokens.tolist() == [1]
