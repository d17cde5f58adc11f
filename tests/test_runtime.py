"""KV rollback: truncating the cache and feeding again equals a fresh forward."""

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama

from verispec.runtime import HFRunner


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_rollback_then_forward_equals_fresh_forward(make):
    model = make(50, seed=0)
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids.unsqueeze(0)).logits[0]  # [30, V]
    runner = HFRunner(model)
    runner.logits(ids[:20], 1)
    # A rejected draft: five wrong tokens enter the cache, then the true continuation arrives.
    wrong = torch.cat([ids[:20], (ids[20:25] + 1) % 50])
    runner.logits(wrong, 6)
    assert runner.cached_length == 25
    logits = runner.logits(ids, 10)  # rolls back to 20, feeds 10
    assert runner.cached_length == 30
    torch.testing.assert_close(logits, reference[-10:], rtol=1e-9, atol=1e-9)


def test_explicit_rollback_and_reuse_of_shared_prefix():
    model = tiny_llama(50, seed=1)
    runner = HFRunner(model)
    ids = torch.arange(12) % 50
    runner.logits(ids, 1)
    runner.rollback(4)
    assert runner.cached_length == 4
    calls = runner.forward_calls
    torch.testing.assert_close(runner.logits(ids, 2), HFRunner(model).logits(ids, 2),
                               rtol=1e-9, atol=1e-9)
    assert runner.forward_calls == calls + 1


def test_context_overflow_is_a_clear_error():
    runner = HFRunner(tiny_llama(50, seed=0))
    with pytest.raises(ValueError, match="context"):
        runner.logits(torch.zeros(2100, dtype=torch.long), 1)


def test_preallocated_cache_grows_and_rolls_back_across_its_capacity():
    model = tiny_llama(50, seed=2)
    ids = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids.unsqueeze(0)).logits[0]
    runner = HFRunner(model)
    runner.logits(ids[:250], 1)  # fits the first buffer
    runner.logits(ids[:300], 50)  # grows past it
    runner.rollback(240)  # back below the old capacity
    torch.testing.assert_close(runner.logits(ids, 160), reference[240:], rtol=1e-9, atol=1e-9)
    layer = runner._cache.layers[0]
    assert type(layer).__name__ == "PreallocatedLayer" and layer.get_seq_length() == 400
