"""Runners: KV rollback (truncating the cache and feeding again equals a fresh forward), and
the hidden states a native runner keeps for a feature draft, which belong to the runner."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama

from verispec.distill.feature_head import FeatureHead
from verispec.drafters.feature import FeatureDrafter
from verispec.errors import IncompatibleDraftError
from verispec.params import SamplingParams
from verispec.runtime import HFRunner, Runner, batched_logits
from verispec.runtime.hf import grouped_sdpa
from verispec.runtime.native import LlamaShape, NativeLlama, NativeRunner


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


def test_taps_belong_to_the_runner_and_a_conflict_is_a_clear_error():
    model = tiny_llama(50, seed=3, layers=3, dtype=torch.float32)
    ids = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    native = NativeLlama.from_hf(model, torch.float32)
    runner = NativeRunner(native)
    assert isinstance(runner, Runner) and isinstance(HFRunner(model), Runner)
    runner.logits(ids, 1)
    with pytest.raises(ValueError, match="keeps no taps"):
        runner.tapped_states(0, 1)
    runner.keep_taps((2,))
    assert runner.tap_layers == (2,) and runner.cached_length == 0  # untapped positions forgotten
    runner.logits(ids, 1)
    runner.keep_taps((2,))  # the taps it keeps: nothing changes
    runner.keep_taps(())  # none asked: nothing changes
    assert runner.cached_length == ids.numel()
    with pytest.raises(ValueError, match=r"keeps the hidden states after layers \(2,\), not"):
        runner.keep_taps((1, 2))
    for bad in ((0,), (3,), (1, 1)):
        with pytest.raises(ValueError, match="taps must be distinct layer counts"):
            NativeRunner(native).keep_taps(bad)
    with pytest.raises(ValueError, match="not all cached"):
        runner.features(0, ids.numel() + 1)
    assert NativeRunner(native).features(0, 0).shape == (0, model.config.hidden_size)
    # Another runner of the same model keeps other taps; a sibling keeps its runner's.
    other = NativeRunner(native, tap_layers=(1, 2))
    assert runner.sibling().tap_layers == (2,) and NativeRunner(native).tap_layers == ()
    # Rows that keep different taps share one pass, each keeping its own.
    batched_logits([runner, other], [ids, ids], [1, 1])
    torch.testing.assert_close(runner.tapped_states(0, 20)[:, 0], hidden[2][0],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(other.tapped_states(0, 20), torch.stack([hidden[1][0],
                               hidden[2][0]], dim=1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.features(0, 20), other.features(0, 20), rtol=1e-4, atol=1e-4)


def test_following_a_target_changes_no_model_state():
    """A feature draft asks its target's runner for taps: the target's NativeLlama (shared by
    every runner of it) and the transformers model stay as they were."""
    vocab = 60
    model = tiny_llama(vocab, seed=4, layers=3, dtype=torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    head = FeatureHead(LlamaShape.from_config(model.config), taps=(1, 2))
    head.init_from(model)
    native = NativeLlama.from_hf(model, torch.float32)
    attributes = dict(vars(native))
    runner = NativeRunner(native)
    drafter = FeatureDrafter(head.state_dict(), torch.arange(vocab), model, vocab, taps=(1, 2),
                             tree_width=1)
    drafter.follow(runner)
    history = torch.tensor([5, 6, 7, 8, 9, 10])
    runner.logits(history[:-1], 1)
    assert drafter.propose(history, 2, SamplingParams(), None).tokens.numel() == 2
    assert runner.tap_layers == (1, 2)
    assert vars(native).keys() == attributes.keys()
    assert all(vars(native)[name] is value for name, value in attributes.items())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    # Other runners of the same model are untouched: another draft's taps fit them, not this one.
    fresh = NativeRunner(native)
    assert fresh.tap_layers == ()
    one_tap = FeatureDrafter({**head.state_dict(), "fc_taps.weight": head.fc_taps.weight[:, :32]},
                             torch.arange(vocab), model, vocab, taps=(1,))
    with pytest.raises(IncompatibleDraftError, match="another feature draft"):
        one_tap.fork().follow(runner)
    one_tap.follow(fresh)
    assert fresh.tap_layers == (1,) and runner.tap_layers == (1, 2)


def test_grouped_sdpa_attention_matches_transformers_sdpa():
    """The attention verispec loads models with reads grouped KV heads in place; its logits equal
    stock SDPA's in a prompt pass, a verification pass over a cache (masked) and a decode step,
    and the stock model it was compared with is left on its own attention."""
    ids = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(3))
    stock = tiny_llama(50, seed=5, dtype=torch.float32)
    grouped = tiny_llama(50, seed=5, dtype=torch.float32)
    grouped.set_attn_implementation(grouped_sdpa())
    assert stock.config.num_key_value_heads < stock.config.num_attention_heads
    runners = HFRunner(stock), HFRunner(grouped)
    for length, count in ((30, 1), (36, 6), (37, 1), (40, 3)):
        expected, got = (runner.logits(ids[:length], count) for runner in runners)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert stock.config._attn_implementation == "sdpa"


def test_importing_verispec_changes_no_environment_variable():
    """The library sets nothing process-wide: the CLI entry sets HF_HUB_OFFLINE for its own
    process, and the loader passes local_files_only and its attention per model."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_SDPA_FORCE_GQA")}
    script = ("import os; before = dict(os.environ); import verispec, verispec.runtime; "
              "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "[]", out.stdout
