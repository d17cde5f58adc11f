"""The command line: --json output, streaming text, and errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from verispec import SpeculativeDecoder
from verispec.cli import main
from verispec.runtime import HFRunner
from verispec.runtime.native import NativeRunner

STAT_FIELDS = {"target_forwards", "drafted", "checked", "accepted", "acceptance_rate",
               "per_position_acceptance", "tokens_per_forward", "expected_tokens", "wall_s",
               "tokens_per_s"}


def run_json(capsys, *args):
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_and_ngram_equals_plain(capsys, model_folders):
    common = ["abcabcabc", "--target", str(model_folders / "target"), "--temperature", "0",
              "--max-new-tokens", "24", "--ignore-eos"]
    spec = run_json(capsys, *common, "--draft", "ngram")
    plain = run_json(capsys, *common, "--draft", "none")
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert set(spec["stats"]) >= STAT_FIELDS
    assert plain["stats"]["drafted"] == 0 and plain["stats"]["tokens_per_forward"] == 1.0


def test_runtime_flags(capsys, model_folders, monkeypatch):
    """--runtime, --dtype and --int8 reach the engine: the decoder the command builds runs the
    runtime, dtype and weights asked for, and the float32 runtimes agree on greedy output."""
    built = []
    from_config = SpeculativeDecoder.from_config.__func__

    def keep(cls, config):
        built.append(from_config(cls, config))
        return built[-1]

    monkeypatch.setattr(SpeculativeDecoder, "from_config", classmethod(keep))
    common = ["abcabc", "--target", str(model_folders / "target"), "--draft", "ngram",
              "--max-new-tokens", "12", "--ignore-eos", "--temperature", "0"]
    outputs = {}
    for name, flags in (("hf", ["--runtime", "hf"]),
                        ("native float32", ["--runtime", "native", "--dtype", "float32"]),
                        ("native int8", ["--runtime", "native", "--int8"])):
        outputs[name] = run_json(capsys, *common, *flags)["token_ids"]
        assert len(outputs[name]) == 12
    hf, native32, int8 = (decoder.target for decoder in built)
    assert isinstance(hf, HFRunner) and hf.model.dtype == torch.float32
    assert isinstance(native32, NativeRunner) and isinstance(int8, NativeRunner)
    assert native32.model.dtype == torch.float32 and native32.model.lm_head.scales is None
    assert int8.model.dtype == torch.bfloat16 and int8.model.lm_head.scales is not None
    assert "int8 weights" in int8.describe() and "int8" not in native32.describe()
    assert outputs["native float32"] == outputs["hf"]
    assert main(["generate", *common, "--runtime", "hf", "--int8"]) == 2
    assert "native runtime" in capsys.readouterr().err


def test_hybrid_draft_equals_plain(capsys, model_folders):
    common = ["abcabc abcabc", "--target", str(model_folders / "target"), "--max-new-tokens",
              "16", "--ignore-eos", "--k", "3"]
    hybrid = run_json(capsys, *common, "--draft", f"hybrid:{model_folders / 'draft'}")
    assert hybrid["token_ids"] == run_json(capsys, *common, "--draft", "none")["token_ids"]
    assert hybrid["stats"]["drafted"] > 0


def test_draft_model_and_sampling_flags(capsys, model_folders):
    out = run_json(capsys, "hello", "--target", str(model_folders / "target"), "--draft",
                   str(model_folders / "draft"), "--k", "3", "--temperature", "0.8",
                   "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3",
                   "--max-new-tokens", "16", "--ignore-eos")
    assert len(out["token_ids"]) == 16 and out["stats"]["drafted"] > 0


def test_streaming_prints_text_and_stats(capsys, model_folders):
    assert main(["generate", "abc", "--target", str(model_folders / "target"),
                 "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "acceptance" in captured.err


def test_bad_input_exits_2_with_a_message(capsys, model_folders, tmp_path):
    target = str(model_folders / "target")
    cases = [
        ["generate", "", "--target", target],
        ["generate", "x", "--target", target, "--k", "-1"],
        ["generate", "x", "--target", target, "--temperature", "-1"],
        ["generate", "x", "--target", target, "--top-p", "1.5"],
        ["generate", "x", "--target", target, "--max-new-tokens", "0"],
        ["generate", "x", "--target", str(tmp_path / "missing")],
        ["generate", "x", "--target", target, "--draft", "hybrid"],  # nothing shipped for it
        ["generate", "x", "--target", target, "--tree-width", "0"],
        ["serve", "--target", target, "--idle-cache-mb", "-1"],  # before the model loads
        ["serve", "--target", target, "--cache-memory-mb", "-1"],
        ["serve", "--target", target, "--api-key", ""],  # not an open server
        ["serve", "--target", target, "--port", "70000"],
        ["generate", "\udcff\udcfe bytes that are not UTF-8", "--target", target],
        ["generate", "x", "--target", target, "--temperature", "inf"],
        ["generate", "x", "--target", target, "--device", "bogus"],
        ["generate", "x", "--target", ""],
        ["generate", "x", "--target", target, "--draft", ""],
    ]
    if not torch.cuda.is_available():
        cases.append(["generate", "x", "--target", target, "--device", "cuda"])
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") or "\nerror: " in err
        assert "Traceback" not in err


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(capsys, model_folders,
                                                                     monkeypatch):
    """A port in use or a host this machine does not have failed with uvicorn's own error
    (status 3) once the model had loaded: now `error:` and status 2, and nothing loads."""
    import socket

    import verispec.cli as cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "serve_decoder", no_loading)
    target = str(model_folders / "target")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv in (["serve", "--target", target, "--port", str(port)],
                     ["serve", "--target", target, "--host", "999.1.1.1"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("error: ") and "listen" in err and "Traceback" not in err


def test_console_script_reports_missing_model_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "generate", "hi", "--target",
         str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "error: model not found" in result.stderr and "Traceback" not in result.stderr
