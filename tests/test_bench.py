"""The benchmark end to end on tiny models: every method, outputs written, metrics coherent."""

from __future__ import annotations

import json
import math

import pytest

from verispec import SpeculativeDecoder
from verispec.bench import BenchConfig, run_bench
from verispec.bench.prompt_sets import builtin_prompts, load_jsonl
from verispec.config import EngineConfig


def test_bench_runs_every_method_and_writes_outputs(model_folders, tmp_path):
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             draft=str(model_folders / "draft")),
                         methods=("baseline", "ngram", "draft", "hf-baseline", "hf-ngram",
                                  "hf-assisted"),
                         ks=(2, "auto"), per_category=1, limit=3, max_new_tokens=12,
                         out=tmp_path / "out")
    results = run_bench(config, progress=False)
    names = set(results["methods"])
    assert names == {"baseline", "ngram[k=2]", "ngram[k=auto]", "draft[k=2]", "draft[k=auto]",
                     "hf-baseline", "hf-ngram", "hf-assisted"}
    for name, entry in results["methods"].items():
        overall = entry["overall"]
        assert overall["new_tokens"] == 3 * 12  # fixed lengths: EOS ignored
        if name not in ("baseline", "hf-baseline"):
            assert entry["greedy_equal_to_baseline"] == "3/3"  # exact, also HF's own methods
        assert overall["speedup"] == pytest.approx(
            overall["tokens_per_s"]
            / results["methods"]["baseline" if entry["runtime"] == "verispec"
                                 else "hf-baseline"]["overall"]["tokens_per_s"])
    assert results["methods"]["baseline"]["overall"]["tokens_per_forward"] == 1.0
    assert results["methods"]["draft[k=2]"]["overall"]["acceptance_rate"] is not None
    assert set(results["costs"]) == {"ngram[k=auto]", "draft[k=auto]"}
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"results.json", "report.md", "speedup_by_category.png",
            "acceptance_by_position.png", "tokens_per_forward_vs_gamma.png"} <= written
    written_results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written_results["methods"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| draft[k=2] |" in report
    # the record names the machine, the commit and the command that produced it
    record = written_results["provenance"]
    assert record == results["provenance"]
    assert record["cpu"]["model"] and record["cpu"]["logical_cpus"] >= 1
    assert record["cpu"]["kernel_path"] in ("amx", "avx512-bf16", "none")
    assert set(record["commit"]) == {"sha", "dirty", "version"}
    assert record["command"] and record["recorded_at"]
    assert f"Machine: {record['cpu']['model']}" in report
    assert f"Command: `{record['command']}`" in report
    if record["commit"]["sha"] is not None:  # a git checkout: the tests run from one in CI
        assert record["commit"]["sha"] in report and isinstance(record["commit"]["dirty"], bool)


ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma f16c\n\n" \
       "processor\t: 1\nmodel name\t: other\nflags\t\t: avx512_bf16 amx_tile amx_bf16\n"
ZEN4 = "model name\t: AMD EPYC 9R14\nflags\t\t: avx2 fma f16c avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = ("model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: avx2 fma f16c "
                   "avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
NEOVERSE = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, model, kernel_path, has, lacks", [
    (ZEN3, "AMD EPYC 7B13", "none", {"avx2", "fma", "f16c"}, {"avx512_bf16", "amx_bf16"}),
    (ZEN4, "AMD EPYC 9R14", "avx512-bf16", {"avx512_bf16"}, {"amx_tile", "amx_bf16"}),
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8488C", "amx", {"avx512_bf16", "amx_bf16"}, set()),
    (NEOVERSE, None, "none", {"asimd", "sve", "bf16"}, set()),
], ids=["zen3", "zen4", "sapphire-rapids", "arm"])
def test_cpu_info_names_the_isa_that_decides_verispec_s_path(cpuinfo, model, kernel_path, has,
                                                              lacks):
    from verispec.bench.provenance import cpu_info

    info = cpu_info(cpuinfo)
    if model is not None:
        assert info["model"] == model  # the first processor's block, not a later one's
    assert info["kernel_path"] == kernel_path
    assert all(info["isa"][flag] for flag in has)
    assert not any(info["isa"][flag] for flag in lacks)
    assert cpu_info("")["isa"] == {} and cpu_info("")["kernel_path"] == "none"


def test_git_commit_names_the_commit_and_whether_the_tree_differs(tmp_path):
    import shlex
    import shutil
    import subprocess

    from verispec.bench.provenance import command_line, git_commit

    argv = ["/opt/venv/bin/verispec", "bench", "--prompts", "my questions.jsonl", "--k", "1,auto"]
    assert shlex.split(command_line(argv)) == ["verispec", *argv[1:]]
    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                               "user.email=t@t", *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    assert git_commit(repo)["sha"] is None  # not a checkout yet
    git("init", "-q")
    (repo / "a.txt").write_text("one")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    clean = git_commit(repo)
    assert clean["sha"] == git("rev-parse", "HEAD") and clean["dirty"] is False
    (repo / "a.txt").write_text("two")
    assert git_commit(repo)["dirty"] is True
    (repo / "sub").mkdir()
    assert git_commit(repo / "sub")["sha"] is None  # inside a checkout, but not its top


def test_methods_needing_a_draft_are_skipped_with_a_note(model_folders, tmp_path):
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target")),
                         methods=("baseline", "draft"), limit=1, max_new_tokens=4, out=tmp_path)
    results = run_bench(config, progress=False)
    assert list(results["methods"]) == ["baseline"]
    assert any("draft skipped" in note for note in results["notes"])


def test_spec_bench_jsonl_sampling(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"question {i}", "again"]}
            for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    chosen = load_jsonl(path, per_category=3, seed=1)
    assert [p.category for p in chosen] == ["a"] * 3 + ["b"] * 3
    assert chosen == load_jsonl(path, per_category=3, seed=1)
    assert chosen != load_jsonl(path, per_category=3, seed=2)
    path.write_text('{"question_id": 1}\n')
    with pytest.raises(ValueError, match="not a Spec-Bench question"):
        load_jsonl(path, 1, 0)
    # every odd line is refused naming its line, none silently misread
    good = '{"question_id": 1, "category": "a", "turns": ["hello"]}'
    for line, match in [("[1, 2, 3]", "object"), ('"just a string"', "object"),
                        ('{"question_id": 2, "category": "a", "turns": "Hello"}', "list"),
                        ('{"question_id": 2, "category": "a", "turns": [{"role": "user"}]}',
                         "list"),
                        ('{"question_id": 2, "category": "a", "turns": [" "]}', "empty"),
                        ('{"question_id": 2, "category": "a", "turns": ["x"], '
                         '"prediction": 5}', "prediction")]:
        path.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(ValueError, match=f"q.jsonl:3: not a Spec-Bench question.*{match}"):
            load_jsonl(path, 1, 0)
    path.write_bytes(good.encode() + b'\n{"question_id": 2, "category": "a", "turns": ["\xe9"]}\n')
    with pytest.raises(ValueError, match="q.jsonl:2: not UTF-8"):
        load_jsonl(path, 1, 0)
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no questions"):
        load_jsonl(path, 1, 0)


def test_builtin_prompts_cover_categories():
    prompts = builtin_prompts(per_category=1)
    assert len({p.category for p in prompts}) == len(prompts) >= 8


@pytest.mark.parametrize("bad", [dict(methods=("nope",)), dict(ks=("fast",)),
                                 dict(max_new_tokens=0), dict(prompts="/no/such/file"),
                                 dict(methods=("baseline", "ngram", "baseline")),
                                 dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(seed=-5), dict(hf_ngram_tokens=-1)])
def test_bad_bench_config(bad):
    with pytest.raises(ValueError):
        BenchConfig(**bad)


def test_bench_refuses_what_it_can_before_loading_a_model(tmp_path, monkeypatch):
    """An output folder it cannot write and a bad prompt file are refused before any model
    loads (not after the whole run, which then lost its results)."""
    import verispec.bench.harness as harness

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(harness.loading, "load", no_load)
    a_file = tmp_path / "results.jsonl"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        BenchConfig(out=a_file)
    with pytest.raises(ValueError, match="cannot write the results"):
        run_bench(BenchConfig(out=a_file / "inside"), progress=False)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": "Hello"}\n')
    with pytest.raises(ValueError, match="not a Spec-Bench question"):
        run_bench(BenchConfig(prompts=prompts, out=tmp_path / "out"), progress=False)


def test_hf_methods_really_ignore_eos(text_target, tokenizer):
    """transformers fills an unset eos_token_id from the model's generation config; a
    fixed-length run must clear it there, or HF methods would stop early and look faster."""
    import copy

    from verispec import SamplingParams, SpeculativeDecoder
    from verispec.bench.methods import HFMethod

    model = copy.deepcopy(text_target)
    prompt = tokenizer("abc")["input_ids"]
    first = SpeculativeDecoder(model, tokenizer, None).generate(
        prompt, SamplingParams(max_new_tokens=1)).token_ids[0]
    model.generation_config.eos_token_id = first  # the very first greedy token is now "EOS"
    run = HFMethod("hf-baseline", model, frozenset({first})).run(
        prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(run.token_ids) == 10 and run.target_forwards == 10
    assert model.generation_config.eos_token_id == first  # restored
    stopped = HFMethod("hf-baseline", model, frozenset({first})).run(
        prompt, SamplingParams(max_new_tokens=10))
    assert stopped.token_ids == [first]


@pytest.mark.parametrize("queue", [1, 4], ids=["static", "continuous"])
def test_batched_benchmark_compares_with_plain_batched_decoding(model_folders, tmp_path, queue):
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             draft=str(model_folders / "draft"), runtime="native"),
                         methods=("ngram", "baseline", "draft", "hf-baseline"), limit=5,
                         max_new_tokens=10, ks=(2,), batch_sizes=(1, 2, 4), out=tmp_path / "b",
                         batch_queue=queue)
    results = run_bench(config, progress=False)
    by_batch = results["batch"]["by_batch"]
    assert list(by_batch) == [1, 2, 4]
    for size in (1, 2, 4):
        assert set(by_batch[size]) == {"baseline", "ngram", "draft"}
        assert by_batch[size]["baseline"]["speedup"] == 1.0
        assert by_batch[size]["ngram"]["greedy_equal_to_baseline"] == "5/5"
        assert by_batch[size]["draft"]["greedy_equal_to_baseline"] == "5/5"
        assert by_batch[size]["draft"]["new_tokens"] == 50
    assert any("hf-baseline skipped" in note for note in results["notes"])
    report = (tmp_path / "b" / "report.md").read_text()
    assert "| 4 | draft |" in report
    assert ("static batch" in report) == (queue == 1)
    # decoding after each static batch's first tokens, the prompts' passes left out; none
    # where rows join mid-run
    for size in (1, 2, 4):
        for entry in by_batch[size].values():
            if queue == 1:
                assert entry["decode_tokens_per_s"] > 0 and entry["decode_speedup"] > 0
            else:
                assert entry["decode_tokens_per_s"] is None
        assert queue != 1 or by_batch[size]["baseline"]["decode_speedup"] == 1.0
    assert ("decode speedup" in report) == (queue == 1)
    assert (tmp_path / "b" / "throughput_by_batch.png").is_file()
    with pytest.raises(ValueError, match="baseline"):
        BenchConfig(methods=("ngram",), batch_sizes=(2,))
    with pytest.raises(ValueError, match="batch_queue"):
        BenchConfig(batch_sizes=(2,), batch_queue=0)


def test_timed_batched_runs_never_see_text_written_for_the_same_prompts(model_folders,
                                                                        tmp_path, monkeypatch):
    """A suffix lookup copies what it has read: every batch size runs the same prompts, so the
    text its warm-up and the smaller batches wrote must be gone before each size's timed runs
    (else the larger batches copy their own answers and look faster than they are)."""
    held = []  # per timed generate of the suffix method: tokens its cache held at the start
    generate = SpeculativeDecoder.generate

    def spied(self, prompt, params=None, **kwargs):
        lookup = self.drafter
        if params is not None and params.max_new_tokens == 10 and hasattr(lookup, "cache"):
            held.append((kwargs.get("max_batch"), lookup.cache.usage().tokens))
        return generate(self, prompt, params, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spied)
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             runtime="native"),
                         methods=("baseline", "suffix"), limit=2, max_new_tokens=10,
                         batch_sizes=(1, 2), out=tmp_path / "b")
    run_bench(config, progress=False)
    first = {}  # per batch size: the tokens held at its first timed run
    for size, tokens in held:
        first.setdefault(size, tokens)
    assert first == {1: 0, 2: 0}, held


def _count_measurements(monkeypatch):
    """Spy on the decoder's cost measurements: a list of (kind, batch size) per measurement."""
    import verispec.cost_table as table_module

    measured = []
    one_row, batch = table_module.measure_costs, table_module.measure_batch_costs

    def measure_costs(*args, **kwargs):
        measured.append(("one-row", 1))
        return one_row(*args, **kwargs)

    def measure_batch_costs(*args, **kwargs):
        measured.append(("batch", kwargs["batch"]))
        return batch(*args, **kwargs)

    monkeypatch.setattr(table_module, "measure_costs", measure_costs)
    monkeypatch.setattr(table_module, "measure_batch_costs", measure_batch_costs)
    return measured


def test_verify_modes_of_one_method_share_one_cost_model(model_folders, tmp_path, monkeypatch):
    """A method's verify modes at one K price rounds with one cost model, measured once: two
    measurements differ by the machine's drift, and K with them, which would confound a
    block-against-token comparison. The report shows one model per (method, K)."""
    measured = _count_measurements(monkeypatch)
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             draft=str(model_folders / "draft")),
                         methods=("baseline", "draft"), ks=("auto", 2),
                         verifies=("token", "block", "invariant"), temperature=1.0, limit=1,
                         max_new_tokens=6, out=tmp_path / "out")
    results = run_bench(config, progress=False)
    assert {"draft[k=auto][token]", "draft[k=auto][block]", "draft[k=auto][invariant]",
            "draft[k=2][token]"} <= set(results["methods"])
    assert measured == [("one-row", 1)]  # the fixed-K methods price nothing
    assert list(results["costs"]) == ["draft[k=auto]"]
    shared = results["costs"]["draft[k=auto]"]
    assert shared["methods"] == ["draft[k=auto][token]", "draft[k=auto][block]",
                                 "draft[k=auto][invariant]"]
    assert shared["draft_step"] >= 0.0 and len(shared["verify"]) > 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert ("- draft[k=auto] (shared by draft[k=auto][token], draft[k=auto][block], "
            "draft[k=auto][invariant]): draft step c = ") in report


def test_methods_of_one_draft_model_are_priced_by_one_measurement(model_folders, tmp_path,
                                                                  monkeypatch):
    """The draft-model method and the default beside lookups draft with one model on one
    target: one measurement prices both (measured apart, each would be priced by its own
    minute of machine noise), and n-gram and suffix lookups share another; each decoder
    still keeps its own record of what its rounds took."""
    measured = _count_measurements(monkeypatch)
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             draft=str(model_folders / "draft")),
                         methods=("baseline", "draft", "hybrid", "ngram", "suffix"), limit=1,
                         max_new_tokens=6, out=tmp_path / "out")
    results = run_bench(config, progress=False)
    assert measured == [("one-row", 1), ("one-row", 1)]
    costs = results["costs"]
    assert costs["draft"]["verify"] == costs["hybrid"]["verify"]
    assert costs["draft"]["draft_step"] == costs["hybrid"]["draft_step"]
    assert costs["ngram"]["verify"] == costs["suffix"]["verify"]


def test_batched_bench_runs_each_verify_mode_on_shared_cost_models(model_folders, tmp_path,
                                                                     monkeypatch):
    """The batched benchmark runs each method under its own verify mode, and a method's verify
    modes share the cost model of every batch size: each is measured once."""
    from verispec import SamplingParams, SpeculativeDecoder

    measured = _count_measurements(monkeypatch)
    verifies = set()
    generate = SpeculativeDecoder.generate

    def spy(self, prompt, params=None, *args, **kwargs):
        if isinstance(params, SamplingParams) and not params.greedy:  # the timed runs
            verifies.add((self.drafter is not None, params.verify))
        return generate(self, prompt, params, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    config = BenchConfig(engine=EngineConfig(target=str(model_folders / "target"),
                                             draft=str(model_folders / "draft"), runtime="native"),
                         methods=("baseline", "draft"), verifies=("token", "block"),
                         temperature=1.0, limit=2, max_new_tokens=6, batch_sizes=(1, 2),
                         batch_queue=1, out=tmp_path / "b")
    results = run_bench(config, progress=False)
    assert set(results["batch"]["by_batch"][2]) == {"baseline", "draft[token]", "draft[block]"}
    assert verifies == {(False, "block"), (True, "token"), (True, "block")}
    assert sorted(measured) == [("batch", 2), ("one-row", 1)]
