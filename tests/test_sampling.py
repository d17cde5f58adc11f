import pytest
import torch

from verispec import SamplingParams
from verispec.sampling import warp

LOGITS = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])


def test_temperature_one_is_softmax():
    torch.testing.assert_close(warp(LOGITS, SamplingParams(temperature=1.0)),
                               torch.softmax(LOGITS, -1))


def test_temperature_sharpens_and_flattens():
    cold = warp(LOGITS, SamplingParams(temperature=0.5))
    hot = warp(LOGITS, SamplingParams(temperature=2.0))
    assert cold[0, 0] > torch.softmax(LOGITS, -1)[0, 0] > hot[0, 0]


def test_top_k_keeps_k_tokens():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).sum().item() == 2
    torch.testing.assert_close(probs[0, :2], torch.softmax(LOGITS[0, :2], -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(LOGITS, -1)[0]  # [0.636, 0.234, 0.086, 0.032, 0.012]
    probs = warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))[0]
    assert (probs > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(probs[:2], full[:2] / full[:2].sum())
    # A p below the top token's mass keeps just that token.
    assert (warp(LOGITS, SamplingParams(temperature=1.0, top_p=0.1)) > 0).sum().item() == 1


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = warp(LOGITS, SamplingParams(temperature=1.0, min_p=0.1))[0]
    # 0.636 * 0.1 = 0.064: tokens 0..2 survive (0.086 > 0.064), 3 and 4 do not.
    assert (probs > 0).tolist() == [True, True, True, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        warp(LOGITS, SamplingParams(temperature=0.0))


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-0.5),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0), dict(seed="x"),
    dict(stop=("",)), dict(temperature=float("nan")),
])
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)
