"""llama.cpp in the bench, against a fake llama-server (a small script written here that answers
/health and /completion as llama-server does, with llama.cpp-style timings)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from verispec.bench import BenchConfig, llamacpp, run_bench
from verispec.config import EngineConfig
from verispec.params import SamplingParams

FAKE_SERVER = '''#!{python}
"""A fake llama-server: token i of an answer is prompt[-1] + 1 + i; 20 ms a token."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

argv = sys.argv[1:]
with open(Path(__file__).with_name("calls.jsonl"), "a") as calls:
    calls.write(json.dumps(argv) + "\\n")
if os.environ.get("FAKE_LLAMA_CRASH"):
    print("error: failed to load model", flush=True)
    sys.exit(1)
port = int(argv[argv.index("--port") + 1])
draft = "-md" in argv

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(Path(__file__).with_name("requests.jsonl"), "a") as log:
            log.write(json.dumps(request) + "\\n")
        n = request["n_predict"] - int(os.environ.get("FAKE_LLAMA_SHORT", "0"))
        tokens = [request["prompt"][-1] + 1 + i for i in range(n)]
        timings = {{"prompt_n": len(request["prompt"]), "prompt_ms": 10.0, "predicted_n": n,
                   "predicted_ms": 20.0 * n, "predicted_per_second": 50.0}}
        if draft:
            timings.update(draft_n=2 * n, draft_n_accepted=n)
        self.reply({{"content": "", "tokens": tokens, "timings": timings}})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_llama(tmp_path) -> Path:
    """A folder with the fake llama-server in bin/ (as a llama.cpp build or release has it)."""
    folder = tmp_path / "llama.cpp" / "bin"
    folder.mkdir(parents=True)
    script = folder / "llama-server"
    script.write_text(FAKE_SERVER.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "llama.cpp"


def calls(fake_llama: Path) -> list[list[str]]:
    path = fake_llama / "bin" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)


def test_plain_method_parses_llama_cpp_timings_and_counts(fake_llama, tmp_path):
    target = tmp_path / "t.gguf"
    methods, notes = llamacpp.build_methods(("baseline", "llama.cpp"), fake_llama, target, None,
                                            threads=2)
    assert [m.name for m in methods] == ["llama.cpp"]
    run = methods[0].run([7, 8, 9], GREEDY)
    assert run.token_ids == [10, 11, 12, 13, 14]
    assert run.wall_s == pytest.approx((10.0 + 5 * 20.0) / 1e3)  # its prompt pass included
    assert run.decode_tokens_per_s == 50.0
    assert run.target_forwards == 5 and run.accepted is None
    argv = calls(fake_llama)[0]
    assert flag(argv, "-m") == str(target) and flag(argv, "-t") == "2" and "-md" not in argv
    assert "--no-cache-prompt" in argv  # every run pays its prompt, as verispec's do
    request = json.loads((fake_llama / "bin" / "requests.jsonl").read_text().splitlines()[0])
    assert request["prompt"] == [7, 8, 9] and request["n_predict"] == 5
    assert request["temperature"] == 0.0 and request["ignore_eos"] is True
    methods[0].run([1], GREEDY)
    assert len(calls(fake_llama)) == 1  # one server for the whole run
    methods[0].server.close()


def test_draft_methods_sweep_llama_cpp_settings(fake_llama, tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    methods, _ = llamacpp.build_methods(("llama.cpp-draft",), fake_llama, target, draft, 2)
    assert [m.name for m in methods] == ["llama.cpp-draft[n=3,p=0]", "llama.cpp-draft[n=3,p=0.75]",
                                         "llama.cpp-draft[n=8,p=0]", "llama.cpp-draft[n=8,p=0.75]"]
    run = methods[3].run([1, 2], GREEDY)
    assert (run.accepted, run.checked) == (5, 10)
    assert run.target_forwards == 0  # llama.cpp does not report its speculative passes
    argv = calls(fake_llama)[0]
    assert flag(argv, "-md") == str(draft) and flag(argv, "--spec-type") == "draft-simple"
    assert flag(argv, "--spec-draft-n-max") == "8" and flag(argv, "--spec-draft-p-min") == "0.75"
    methods[3].server.close()


def test_plots_take_speculative_runs_without_a_pass_count(tmp_path):
    """llama.cpp's speculative runs report drafted and accepted tokens but no passes (0): the
    tokens-per-pass plot leaves them out instead of dividing by zero."""
    from verispec.bench import plots

    record = {"method": "llama.cpp-draft[n=3,p=0]", "accepted": 5, "checked": 10,
              "new_tokens": 8, "target_forwards": 0}
    plots._tau_vs_gamma([record], {record["method"]: {}}, tmp_path / "tau.png")
    assert (tmp_path / "tau.png").is_file()


def test_a_short_answer_is_an_error(fake_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SHORT", "1")
    methods, _ = llamacpp.build_methods(("llama.cpp",), fake_llama, tmp_path / "t.gguf", None, 1)
    with pytest.raises(llamacpp.LlamaCppError, match="generated 4 tokens, 5 were asked"):
        methods[0].run([1, 2], GREEDY)
    methods[0].server.close()


def test_a_server_that_cannot_start_is_a_clear_error(fake_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "1")
    methods, _ = llamacpp.build_methods(("llama.cpp",), fake_llama, tmp_path / "t.gguf", None, 1)
    with pytest.raises(llamacpp.LlamaCppError, match="exited with status 1.*failed to load"):
        methods[0].run([1], GREEDY)


@pytest.mark.parametrize("answer, message", [
    ({"tokens": [1, 2], "timings": {"predicted_n": 3, "predicted_ms": 1.0}}, "timed 3 tokens"),
    ({"tokens": [1, 2], "timings": {"predicted_n": 2, "predicted_ms": 1.0, "prompt_n": 1}},
     "processed 1 prompt tokens of 4"),
    ({"content": "hi"}, "no token ids or timings"),
])
def test_inconsistent_answers_are_refused(answer, message):
    with pytest.raises(llamacpp.LlamaCppError, match=message):
        llamacpp.parse_completion("m", answer, 4, SamplingParams(max_new_tokens=2,
                                                                 ignore_eos=True), False)


def test_sampling_maps_onto_llama_cpp_with_its_defaults_off():
    request = llamacpp.completion_request(
        [1], SamplingParams(max_new_tokens=3, temperature=0.7, top_k=5, seed=3))
    assert (request["temperature"], request["top_k"], request["top_p"], request["min_p"]) == (
        0.7, 5, 1.0, 0.0)
    assert request["seed"] == 3 and request["cache_prompt"] is False


def test_absent_binaries_and_non_gguf_models_skip_with_a_note(tmp_path, fake_llama,
                                                              monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    methods, notes = llamacpp.build_methods(("llama.cpp", "llama.cpp-draft"), None,
                                            tmp_path / "t.gguf", None, 1)
    assert methods == [] and "no llama-server on PATH" in notes[0]
    methods, notes = llamacpp.build_methods(("llama.cpp",), tmp_path, tmp_path / "t.gguf",
                                            None, 1)
    assert methods == [] and "give --llama-cpp DIR" in notes[0]
    methods, notes = llamacpp.build_methods(("llama.cpp",), fake_llama, None, None, 1)
    assert methods == [] and "not one" in notes[0]
    methods, notes = llamacpp.build_methods(("llama.cpp", "llama.cpp-draft"), fake_llama,
                                            tmp_path / "t.gguf", None, 1)
    assert [m.name for m in methods] == ["llama.cpp"]
    assert any("llama.cpp-draft skipped: it needs a draft GGUF" in n for n in notes)
    assert calls(fake_llama) == []  # nothing started before a method runs


def test_binary_found_on_path_and_in_build_folders(tmp_path, fake_llama, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_llama / "bin") + os.pathsep + os.environ["PATH"])
    assert llamacpp.find_binary(None) == fake_llama / "bin" / "llama-server"
    assert llamacpp.find_binary(fake_llama) == fake_llama / "bin" / "llama-server"
    build = tmp_path / "src" / "build" / "bin"
    build.mkdir(parents=True)
    (fake_llama / "bin" / "llama-server").rename(build / "llama-server")
    assert llamacpp.find_binary(tmp_path / "src") == build / "llama-server"


def test_the_bench_notes_llama_cpp_skipped_for_a_checkpoint_folder(model_folders, fake_llama,
                                                                    tmp_path):
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target")),
                         methods=("baseline", "llama.cpp"), llama_cpp=str(fake_llama), limit=1,
                         max_new_tokens=4, out=tmp_path / "out")
    results = run_bench(config, progress=False)
    assert list(results["methods"]) == ["baseline"]
    assert any("llama.cpp skipped" in note and "not one" in note for note in results["notes"])
