"""`verispec distill` end to end on a tiny random target: data shards, falling loss, resume, a
small draft folder that loads and drafts losslessly, and the guards around it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import EOS_ID, byte_tokenizer, tiny_llama

from verispec import SamplingParams, SpeculativeDecoder
from verispec.bench.prompt_sets import BUILTIN
from verispec.cli import main
from verispec.distill import DistillConfig, distill
from verispec.distill.data import load_shard
from verispec.distill.train import TrainSettings, head_vocabulary, prepare, train
from verispec.distill.training_prompts import builtin_prompts
from verispec.drafters import ModelDrafter
from verispec.drafters.folder import is_distilled_draft, load_draft
from verispec.drafters.load import load_drafter
from verispec.errors import IncompatibleDraftError
from verispec.sampling import warp

VOCAB = EOS_ID + 1
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / \
    "question.jsonl"


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("distill") / "target"
    tiny_llama(VOCAB, seed=0, layers=3, dtype=torch.float32).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def config(target_folder) -> DistillConfig:
    return DistillConfig(out=target_folder.parent / "run", target=str(target_folder),
                         num_prompts=24, self_prompts=4, eval_prompts=8, shard_prompts=8,
                         max_new_tokens=24, batch_size=8, layers=1, head_vocab=160, steps=60,
                         lr=3e-3, checkpoint_every=30, device="cpu")


@pytest.fixture(scope="module")
def run(config):
    return distill(config)


@pytest.fixture(scope="module")
def target(target_folder):
    from verispec import loading

    return loading.load(target_folder)


def test_data_shards_are_written(run, config):
    data = config.out / "data"
    assert sorted(p.name for p in data.glob("*.safetensors")) == [
        "heldout.safetensors", "shard-00000.safetensors", "shard-00001.safetensors",
        "shard-00002.safetensors"]
    sequences = load_shard(data / "shard-00000.safetensors")
    assert len(sequences) == 8
    for seq in sequences:
        assert 1 <= seq.response_length <= config.max_new_tokens
        assert seq.topk_ids.shape == seq.topk_logprobs.shape == (seq.response_length, 16)
        assert (seq.topk_logprobs[:, :-1] >= seq.topk_logprobs[:, 1:]).all()  # best first
        assert (seq.topk_logprobs.exp().sum(-1) <= 1.001).all()
    progress = json.loads((data / "progress.json").read_text())
    assert progress["shards_done"] == progress["shards_total"] == 4
    assert progress["tokens"] > 0 and progress["tokens_per_s"] > 0
    assert "tokens/s" in (config.out / "train.log").read_text()


def test_shards_keep_the_native_targets_features_of_every_position(run, config, target):
    from verispec.distill.feature_head import target_features
    from verispec.runtime.native.llama import NativeLlama

    model, _ = target
    native = NativeLlama.from_hf(model, torch.bfloat16)
    sequences = load_shard(config.out / "data" / "shard-00000.safetensors")
    for seq in sequences:
        assert seq.features is not None
        assert seq.features.shape == (seq.ids.numel(), model.config.hidden_size)
    stored = target_features(native, sequences, max_length=512)
    fresh = target_features(native, [replace(s, features=None) for s in sequences], 512)
    for a, b in zip(stored, fresh, strict=True):
        assert torch.equal(a.features, b.features)  # the same runtime, the same pass


def test_resumed_run_skips_finished_shards_and_rewrites_lost_ones(run, config):
    data = config.out / "data"
    kept, lost = data / "shard-00000.safetensors", data / "shard-00001.safetensors"
    kept_mtime, lost_bytes = kept.stat().st_mtime_ns, lost.read_bytes()
    lost.unlink()
    distill(replace(config, resume=True))  # training is already at its last step
    assert kept.stat().st_mtime_ns == kept_mtime  # not redone
    assert lost.read_bytes() == lost_bytes  # redone, identically: seeded per shard


def test_training_loss_falls(run):
    losses = run.report.losses
    assert len(losses) == 60
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert 0 <= run.report.heldout_agreement <= 1


def test_draft_folder_is_small_and_loads(run, config, target):
    model, tokenizer = target
    folder = run.draft
    assert is_distilled_draft(folder) and not is_distilled_draft(config.out)
    weights = safetensors.torch.load_file(str(folder / "draft.safetensors"))
    assert "model.embed_tokens.weight" not in weights and "lm_head.weight" not in weights
    assert all(VOCAB not in w.shape for w in weights.values())  # no vocabulary-sized table
    assert weights["head_token_ids"].numel() == 160
    draft, head = load_draft(folder, model, tokenizer)
    assert draft.get_output_embeddings().weight.shape == (160, 32)
    assert draft.get_input_embeddings().weight.data_ptr() == \
        model.get_input_embeddings().weight.data_ptr()  # shared, not copied
    assert torch.equal(head, weights["head_token_ids"])
    assert "top-1 agreement" in (folder / "README.md").read_text()


def test_distilled_draft_greedy_equals_plain_greedy(run, target):
    model, tokenizer = target
    drafter = load_drafter(str(run.draft), model, tokenizer)
    assert isinstance(drafter, ModelDrafter) and drafter.head_token_ids is not None
    plain = SpeculativeDecoder(model, tokenizer, drafter=None)
    spec = SpeculativeDecoder(model, tokenizer, drafter, k=4)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    accepted = 0
    for prompt in ["What is photosynthesis?", "abcabcabc", "Write a poem about the sea."]:
        got = spec.generate(prompt, params)
        assert got.token_ids == plain.generate(prompt, params).token_ids
        assert got.stats.drafted > 0
        accepted += got.stats.accepted
    assert accepted > 0
    sampled = spec.generate("abc", SamplingParams(max_new_tokens=20, temperature=0.8, seed=1,
                                                  ignore_eos=True))
    assert len(sampled.token_ids) == 20


def test_draft_for_another_target_is_refused(run, tmp_path, capsys):
    for other in (tiny_llama(VOCAB + 7, seed=0, layers=1, dtype=torch.float32),
                  _wider_llama()):
        with pytest.raises(IncompatibleDraftError, match="distilled for a target"):
            load_draft(run.draft, other)
    other = tiny_llama(VOCAB + 7, seed=0, layers=1, dtype=torch.float32)
    other.save_pretrained(tmp_path / "other")
    byte_tokenizer().save_pretrained(tmp_path / "other")
    assert main(["generate", "abc", "--target", str(tmp_path / "other"), "--draft",
                 str(run.draft), "--max-new-tokens", "4"]) == 2
    assert "error: " in (err := capsys.readouterr().err) and "distilled for a target" in err


def test_checkpoint_resume_continues_as_if_uninterrupted(run, config, target, tmp_path):
    model, _ = target
    head = torch.load(config.out / "ckpt.pt", weights_only=True)["head_token_ids"]
    sequences = load_shard(config.out / "data" / "shard-00000.safetensors")
    examples = prepare(sequences, head, VOCAB, 512)
    heldout = examples[:2]
    settings = TrainSettings(steps=12, batch_size=4, lr=3e-3, seed=0, checkpoint_every=4,
                             device=torch.device("cpu"))

    def interrupt_at_8(report):
        if report.step == 8:
            raise Interrupted

    from verispec.distill.lm_draft import init_draft

    whole = init_draft(model, 1, head)
    train(whole, examples, heldout, head, settings, tmp_path / "whole.pt", lambda r: None)
    first = init_draft(model, 1, head)
    with pytest.raises(Interrupted):
        train(first, examples, heldout, head, settings, tmp_path / "cut.pt", interrupt_at_8)
    resumed = init_draft(model, 1, head)
    report = train(resumed, examples, heldout, head, settings, tmp_path / "cut.pt",
                   lambda r: None)
    assert report.step == 12 and len(report.losses) == 4  # steps 9..12 only
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_head_subset_scatter_gives_a_proper_q():
    head = torch.tensor([1, 3, 4, 7, 9])
    drafter = ModelDrafter(tiny_llama(VOCAB, seed=2, layers=1), 12, head_token_ids=head)
    logits = drafter._fit_vocab(torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0]]))  # [1, 12]
    outside = torch.ones(12, dtype=torch.bool)
    outside[head] = False
    assert torch.isinf(logits[0, outside]).all() and (logits[0, outside] < 0).all()
    assert logits[0, head].tolist() == [0.5, -1.0, 2.0, 0.0, 1.0]
    q = warp(logits, SamplingParams(temperature=0.7, top_p=0.95))
    assert torch.allclose(q.sum(-1), torch.ones(1)) and (q[0, outside] == 0).all()


def test_head_vocabulary_takes_specials_then_the_most_probable_tokens():
    from verispec.distill.data import Transcript

    rows = torch.tensor([[3, 5], [3, 4]])
    logprobs = torch.tensor([[0.9, 0.1], [0.6, 0.4]]).log()
    seq = Transcript(torch.tensor([0, 3, 3]), 1, rows, logprobs)
    assert head_vocabulary([seq], 2, 10, []).tolist() == [3, 4]
    assert head_vocabulary([seq], 3, 10, [9]).tolist() == [3, 4, 9]
    assert head_vocabulary([seq], 8, 10, []).tolist() == [3, 4, 5]  # only tokens with mass


def test_a_run_on_the_first_shards_writes_only_those_and_says_how_to_redo_it(run, config):
    from verispec.distill.pipeline import command_line

    short = replace(config, out=config.out.parent / "short", train_shards=1, steps=2)
    distill(short)
    data = short.out / "data"
    assert sorted(p.name for p in data.glob("*.safetensors")) == [
        "heldout.safetensors", "shard-00000.safetensors"]
    # the same prompt plan as the full run: its first shard is the full run's first shard
    assert (data / "shard-00000.safetensors").read_bytes() == \
        (config.out / "data" / "shard-00000.safetensors").read_bytes()
    assert "--train-shards 1 " in command_line(short) + " "


def test_a_run_trains_on_the_shards_of_earlier_runs_too(run, config):
    more = replace(config, out=config.out.parent / "more", train_shards=1, steps=2, seed=1,
                   extra_data=(config.out,))
    distill(more)
    log = (more.out / "train.log").read_text()
    # its own shard of 8 prompts and the first run's 3 shards
    assert "3 extra training shards from 1 earlier runs" in log
    assert re.search(r"head of \d+ tokens, 32 training sequences", log)
    other = replace(more, out=config.out.parent / "other-topk", topk=4)
    with pytest.raises(ValueError, match="topk"):
        distill(other)
    with pytest.raises(ValueError, match="not a run folder"):
        distill(replace(more, out=config.out.parent / "nowhere", extra_data=(more.out / "x",)))


def test_self_prompt_replies_resume_where_they_stopped(target, tmp_path, monkeypatch):
    from verispec.distill.data import Teacher, generate_texts

    teacher = Teacher(*target, chat=True)
    requests = [f"Ask a question about topic {i}." for i in range(10)]
    whole = generate_texts(teacher, requests, 8, 2, 1.0, seed=5)
    checkpoint = tmp_path / "replies.json"
    calls, sample = [], teacher.sample

    def interrupted(*args):  # the second chunk of 4 * batch_size rows never finishes
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted
        return sample(*args)

    monkeypatch.setattr(teacher, "sample", interrupted)
    with pytest.raises(Interrupted):
        generate_texts(teacher, requests, 8, 2, 1.0, seed=5, checkpoint=checkpoint)
    assert len(json.loads(checkpoint.read_text())["replies"]) == 8
    resumed_rows = []

    def counted(prompts, *args):
        resumed_rows.append(len(prompts))
        return sample(prompts, *args)

    monkeypatch.setattr(teacher, "sample", counted)
    assert generate_texts(teacher, requests, 8, 2, 1.0, seed=5, checkpoint=checkpoint) == whole
    assert resumed_rows == [2]  # only the rows that were missing
    assert len(set(whole)) > 1


def test_the_command_line_of_a_config_parses_back_to_that_config(tmp_path):
    import shlex
    from dataclasses import fields

    from verispec.cli import build_parser
    from verispec.distill.pipeline import command_line

    config = DistillConfig(out=tmp_path / "run", kind="feature", num_prompts=100, self_prompts=7,
                           greedy_fraction=0.5, chat=False, train_head=True, seq_len=256,
                           train_shards=3, train_batch=4, lr=3e-4,
                           extra_data=(tmp_path / "a", tmp_path / "b"))
    args = build_parser().parse_args(shlex.split(command_line(config))[1:])
    names = {field.name for field in fields(DistillConfig)}
    assert DistillConfig(**{k: v for k, v in vars(args).items() if k in names}) == config


def test_config_validates_itself(tmp_path):
    bad = [{"num_prompts": 0}, {"self_prompts": 10_000}, {"temperature": 0.0},
           {"greedy_fraction": 1.5}, {"lr": -1.0}, {"layers": 0}, {"device": "tpu"},
           {"train_shards": 0}, {"train_batch": True},
           # infinite rates and weights train every weight to NaN
           {"lr": math.inf}, {"lr": math.nan}, {"tv_weight": math.inf},
           {"temperature": math.inf}]
    for fields in bad:
        with pytest.raises(ValueError):
            DistillConfig(out=tmp_path, **fields)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run")
    with pytest.raises(ValueError, match="is a file"):
        DistillConfig(out=a_file)
    # settings that depend on the target: checked against it before any data is written
    config = DistillConfig(out=tmp_path, topk=100, head_vocab=5000, layers=3)
    config.check_target(vocab_size=1000, num_layers=4)  # (a head past it: the whole vocabulary)
    for fields, match in [({"topk": 2000}, "topk"), ({"layers": 5}, "layers"),
                          ({"kind": "feature", "feature_taps": (4,)}, "feature_taps")]:
        with pytest.raises(ValueError, match=match):
            replace(config, **fields).check_target(vocab_size=1000, num_layers=4)


def test_cli_distill_runs_and_reports_errors(target_folder, tmp_path, capsys):
    out = tmp_path / "cli-run"
    common = ["distill", "--target", str(target_folder), "--out", str(out), "--prompts", "8",
              "--self-prompts", "0", "--max-new-tokens", "8", "--layers", "1",
              "--head-vocab", "64", "--steps", "4", "--checkpoint-every", "2", "--device", "cpu"]
    assert main(common) == 0
    assert capsys.readouterr().out.strip() == str(out / "draft")
    assert main(common) == 2  # not empty, no --resume
    assert "error: " in capsys.readouterr().err
    assert main([*common, "--resume", "--max-new-tokens", "9"]) == 2  # data settings changed
    assert "max_new_tokens" in capsys.readouterr().err
    assert main([*common[:-2], "--steps", "0"]) == 2
    # refused before any data is written: nothing appears in the new folder
    fresh = tmp_path / "fresh"
    fresh_args = [*common[:4], str(fresh), *common[5:]]
    for extra, match in ((["--topk", "100000000"], "topk"), (["--lr", "inf"], "lr"),
                         (["--resume"], "nothing to resume")):
        capsys.readouterr()
        assert main([*fresh_args, *extra]) == 2
        assert match in capsys.readouterr().err
        assert not fresh.exists()  # nothing written: the same folder takes a good run


def test_builtin_prompts_hold_no_benchmark_question():
    ours = {_normal(p) for p in builtin_prompts()}
    assert len(ours) >= 150
    bench = {_normal(t) for texts in BUILTIN.values() for t in texts}
    assert not ours & bench
    if not SPEC_BENCH.is_file():
        pytest.skip(f"{SPEC_BENCH} not present")
    questions = [_normal(turn) for line in SPEC_BENCH.read_text().splitlines() if line.strip()
                 for turn in json.loads(line)["turns"]]
    assert not ours & set(questions)
    long_ones = [q for q in questions if len(q) > 40]
    assert not [p for p in ours for q in long_ones if q in p or p in q]


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _wider_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def test_bench_runs_a_distilled_draft_and_hands_transformers_a_full_head(run, config, tmp_path):
    from verispec.bench import BenchConfig, run_bench
    from verispec.config import EngineConfig

    bench = BenchConfig(engine=EngineConfig(target=config.target, draft=str(run.draft)), limit=2,
                        max_new_tokens=12,
                        methods=("baseline", "draft", "hf-baseline", "hf-assisted"),
                        out=tmp_path / "bench")
    results = run_bench(bench, progress=False)
    assert set(results["methods"]) == {"baseline", "draft", "hf-baseline", "hf-assisted"}
    assert results["methods"]["draft"]["greedy_equal_to_baseline"] == "2/2"
    assert results["methods"]["hf-assisted"]["greedy_equal_to_baseline"] == "2/2"


def test_self_prompt_replies_to_other_requests_are_refused(target, tmp_path):
    from verispec.distill.data import Teacher, generate_texts

    teacher = Teacher(*target, chat=True)
    checkpoint = tmp_path / "replies.json"
    generate_texts(teacher, ["Ask about tea.", "Ask about jazz."], 4, 2, 1.0, seed=1,
                   checkpoint=checkpoint)
    with pytest.raises(ValueError, match="other requests"):
        generate_texts(teacher, ["Ask about chess.", "Ask about jazz.", "Ask about maps."], 4, 2,
                       1.0, seed=1, checkpoint=checkpoint)


def test_self_prompt_requests_span_kinds_and_subjects():
    from verispec.distill.training_prompts import FIELDS, REQUEST_KINDS, question_requests

    requests = question_requests(2000, seed=0)
    assert question_requests(2000, seed=0) == requests  # seeded
    kinds = {kind for kind in REQUEST_KINDS for r in requests if r.startswith(kind.split("{}")[0])}
    assert kinds == set(REQUEST_KINDS)
    assert len(set(requests)) > 1000  # 199 subjects x 9 kinds: mostly distinct
    assert sum(any(field in r for field in FIELDS) for r in requests) > 1000


def test_a_repeated_prompt_is_never_decoded_greedily_twice(target, tmp_path):
    from verispec.distill.data import Teacher, _rows
    from verispec.distill.pipeline import shard_plans

    prompts = ["Say hi.", "Count to three.", "Say hi.", "Name a colour.", "Count to three."]
    config = DistillConfig(out=tmp_path, eval_prompts=1, shard_prompts=2)
    plans = shard_plans(prompts, config, tmp_path)
    assert [plan.repeats for plan in plans] == [(False,), (False, True), (False, True)]
    teacher = Teacher(*target, chat=True)
    # Every row greedy-eligible (fraction 1): only first occurrences are greedy.
    temperatures = [_rows(teacher, plan, 1.0, 1.0, 8)[1] for plan in plans]
    assert temperatures == [[None], [None, 1.0], [None, 1.0]]
