"""One configuration: `EngineConfig` is validated when built, and `from_pretrained`, the command
line and the bench all describe a decoder by one."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from verispec import SpeculativeDecoder
from verispec.cli_args import add_model_args, engine_config
from verispec.config import DecodeConfig, EngineConfig


@pytest.mark.parametrize("bad", [
    dict(k="fast"), dict(k=-1), dict(runtime="onnx"), dict(dtype="int4"),
    dict(dequantize="q4"), dict(draft_vocab=-5), dict(draft_vocab=True), dict(draft_quant="q2_k"),
    dict(tree_width=0), dict(sampled_tree_width=99), dict(decode={"auto_k_max": 4})])
def test_a_bad_value_is_refused_when_the_configuration_is_built(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_values_as_users_give_them_are_normalised():
    assert EngineConfig(k="4").k == 4
    assert EngineConfig(k="heuristic").k == "heuristic"
    assert EngineConfig(draft_quant="none").draft_quant is None  # as the flag says it
    assert EngineConfig().as_dict()["decode"] == DecodeConfig().as_dict()


def test_the_command_lines_flags_name_one_configuration():
    """`--draft none`, `--dequantize none` and `--draft-quant none` mean None; `--draft-vocab
    0` the full head; unset trim flags the defaults; the rest verbatim."""
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--target", "m.gguf", "--draft", "none", "--dequantize", "none",
                              "--draft-vocab", "0", "--draft-quant", "none", "--tree-width", "3",
                              "--runtime", "native"])
    assert engine_config(args, k=2) == EngineConfig(
        target="m.gguf", draft=None, k=2, runtime="native", dequantize=None, draft_vocab=None,
        draft_quant=None, tree_width=3)
    defaults = engine_config(parser.parse_args([]))
    assert defaults == EngineConfig()
    assert engine_config(parser.parse_args(["--draft-quant", "q8_0"])).draft_quant == "q8_0"


def test_from_pretrained_keywords_build_the_configuration_the_decoder_keeps(model_folders):
    decode = DecodeConfig(auto_k_max=4)
    decoder = SpeculativeDecoder.from_pretrained(model_folders / "target", draft="ngram", k=3,
                                                 runtime="native", config=decode)
    assert decoder.engine_config == EngineConfig(
        target=str(model_folders / "target"), draft="ngram", k=3, runtime="native",
        decode=decode)
    assert decoder.config is decode and decoder.k == 3
    again = SpeculativeDecoder.from_config(dataclasses.replace(decoder.engine_config, k=1))
    assert again.k == 1 and again.config == decode
    with pytest.raises(ValueError, match="runtime"):  # refused before anything loads
        SpeculativeDecoder.from_pretrained("/no/such/model", runtime="onnx")
