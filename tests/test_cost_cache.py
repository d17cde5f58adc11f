"""The cost-model cache and the cost table: measured once per machine and model, read back by a
later process, measured again when anything that changes a measurement changes; batch sizes
estimated until measured, measured by an idle server's engine and interrupted by a request."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
import torch
from conftest import EOS_ID, tiny_llama

import verispec.cost_table as table_module
from verispec import SamplingParams, SpeculativeDecoder, cost_cache
from verispec.config import DecodeConfig
from verispec.cost_table import CostTable
from verispec.costs import CostModel, MeasurementInterrupted, measure_batch_costs
from verispec.drafters import NgramDrafter
from verispec.runtime import HFRunner

ONE_ROW = CostModel(draft_step=0.05, verify=(1.0, 1.1, 1.2, 1.3, 1.4), target_step_s=0.01,
                    long_verify=(1.0, 1.2, 1.4, 1.6, 1.8), contexts=(128, 1024),
                    long_draft_step=0.07, long_step=1.3, sampling_step=0.2)
BATCH = CostModel(draft_step=0.1, verify=(1.0, 1.5, 2.0, 2.5, 3.0), target_step_s=0.02)


@pytest.fixture
def measured(monkeypatch):
    """The table's measurements replaced by fixed models, counted: [(kind, batch size)]."""
    calls = []

    def one_row(*args, **kwargs):
        calls.append(("one-row", 1))
        return ONE_ROW

    def batch(*args, batch, interrupt=None, **kwargs):
        calls.append(("batch", batch))
        return BATCH

    monkeypatch.setattr(table_module, "measure_costs", one_row)
    monkeypatch.setattr(table_module, "measure_batch_costs", batch)
    return calls


@pytest.fixture(scope="module")
def runner():
    return HFRunner(tiny_llama(EOS_ID + 1, seed=0))


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights " * 64)
    return path


def table(runner, model_file, drafter=None, config=None) -> CostTable:
    """A decoder's table as a new process would build it."""
    return CostTable(runner, drafter or NgramDrafter(), config or DecodeConfig(auto_k_max=4),
                     files=[model_file])


def test_a_later_process_reads_the_models_back_without_measuring(runner, model_file, measured,
                                                                  private_cost_cache):
    first = table(runner, model_file)
    assert first.one_row() == ONE_ROW and first.measure(2) == BATCH
    assert measured == [("one-row", 1), ("batch", 2)]
    later = table(runner, model_file)
    assert later.one_row() == ONE_ROW and later.prices(2) == BATCH  # equal, every field
    assert later.unmeasured(4) == [4]
    assert len(measured) == 2
    assert [p.name for p in private_cost_cache.iterdir()] == [first.cache_path.name]  # no temp


@pytest.mark.parametrize("change", ["rewritten", "touched", "version", "sources", "kernels",
                                    "runtime", "threads", "k_max", "draft"])
def test_what_changes_a_measurement_is_measured_again(runner, model_file, measured, monkeypatch,
                                                      change):
    table(runner, model_file).one_row()
    drafter, config = NgramDrafter(), DecodeConfig(auto_k_max=4)
    if change == "rewritten":
        model_file.write_bytes(b"other weights " * 64)
    elif change == "touched":
        stat = model_file.stat()
        os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    elif change == "version":
        monkeypatch.setattr(cost_cache, "installed_version", lambda: "99.0")
    elif change == "sources":
        monkeypatch.setattr(cost_cache, "sources_hash", lambda: "edited")
    elif change == "kernels":
        monkeypatch.setenv("VERISPEC_KERNELS", "avx2")
    elif change == "runtime":
        monkeypatch.setattr(runner, "describe", lambda: "native float32, GGUF Q4_K weights")
    elif change == "threads":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    elif change == "k_max":
        config = DecodeConfig(auto_k_max=5)
    elif change == "draft":
        drafter = NgramDrafter(max_ngram=3)
    table(runner, model_file, drafter, config).one_row()
    assert measured == [("one-row", 1)] * 2


def test_the_same_configuration_is_not_measured_again(runner, model_file, measured):
    table(runner, model_file).one_row()
    table(runner, model_file, NgramDrafter(), DecodeConfig(auto_k_max=4)).one_row()
    assert measured == [("one-row", 1)]


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]",
                                     b'{"format": 1, "models": {}}', "models"])
def test_an_unreadable_file_is_measured_again_and_rewritten(runner, model_file, measured,
                                                           caplog, content):
    path = table(runner, model_file).cache_path
    if content == "models":  # the right key, a model that is not one
        table(runner, model_file).one_row()
        data = json.loads(path.read_text())
        data["models"]["1"]["verify"] = "fast"
        content = json.dumps(data).encode()
        measured.clear()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    assert table(runner, model_file).one_row() == ONE_ROW  # no traceback
    assert measured == [("one-row", 1)]
    assert table(runner, model_file).one_row() == ONE_ROW  # rewritten whole
    assert measured == [("one-row", 1)]


def test_turned_off_the_cache_is_neither_read_nor_written(runner, model_file, measured,
                                                          monkeypatch, private_cost_cache):
    kept = table(runner, model_file)
    kept.one_row()
    path = kept.cache_path
    before = path.read_bytes()
    monkeypatch.setenv("VERISPEC_COST_CACHE", "0")
    off = table(runner, model_file)
    assert off.cache_path is None
    off.one_row()
    off.measure(2)
    assert measured == [("one-row", 1), ("one-row", 1), ("batch", 2)]  # not read
    assert path.read_bytes() == before  # not written
    assert list(private_cost_cache.iterdir()) == [path]


def test_a_decoder_without_model_files_keeps_nothing(runner, measured, private_cost_cache):
    for _ in range(2):
        assert CostTable(runner, NgramDrafter(), DecodeConfig()).one_row() == ONE_ROW
    assert measured == [("one-row", 1)] * 2
    assert not private_cost_cache.exists()


def test_the_default_folder_is_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("VERISPEC_COST_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_cache.folder() == tmp_path / "verispec" / "costs"
    monkeypatch.setenv("VERISPEC_COST_CACHE", "off")
    assert cost_cache.folder() is None


def test_an_unmeasured_batch_size_is_priced_by_an_estimate(runner, model_file, measured):
    costs = table(runner, model_file)
    assert costs.prices(3) == ONE_ROW.scaled(4)  # batch 3 is priced at size 4
    assert measured == [("one-row", 1)]  # no batch measured for it
    costs.measure(2)
    assert costs.prices(4) == BATCH.scaled(2)  # from the largest measured size below
    assert costs.prices(2) == BATCH


def test_scaling_to_more_rows_follows_the_token_count():
    """The docstring's example: v(1..5) = 1.0 .. 1.4, four times the rows -> v'(2) = v(8) /
    v(4) = 1.7 / 1.3; the long curve alike; the unit grows by v(4), and with the context as
    a pass over 4 positions does."""
    scaled = ONE_ROW.scaled(4)
    assert scaled.verify[1] == pytest.approx(1.7 / 1.3)
    assert scaled.long_verify[1] == pytest.approx(2.4 / 1.6)
    assert scaled.target_step_s == pytest.approx(0.01 * 1.3)
    # the unit is a pass over 4 positions: it grows with the context as that pass does
    assert scaled.long_step == pytest.approx(1.3 * 1.6 / 1.3)
    assert scaled.draft_step == ONE_ROW.draft_step and scaled.verify[0] == 1.0
    assert ONE_ROW.scaled(1) == ONE_ROW
    flat = CostModel(0.0, (1.0, 1.0, 1.0), 0.01)  # free extra positions stay free
    assert flat.scaled(8).verify == (1.0, 1.0, 1.0)
    # a last step flattened by noise: the upper half's mean step, (1.6 - 1.3) / 4, carries on
    noisy = CostModel(0.0, (1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.6), 0.01)
    assert noisy.scaled(2).verify[-1] == pytest.approx(1.6 + 0.075 * 9)
    with pytest.raises(ValueError):
        ONE_ROW.scaled(0.5)


def test_a_batch_measurement_stops_at_the_first_interrupt(runner):
    asked = []

    def interrupt() -> bool:
        asked.append(True)
        return len(asked) == 3

    with pytest.raises(MeasurementInterrupted):
        measure_batch_costs(runner, NgramDrafter(), batch=2, k_max=2, context=300,
                            long_context=600, interrupt=interrupt)
    assert len(asked) == 3  # stopped at once: within row one's prefill (chunks of 256)


def test_verispec_costs_measures_afresh_and_refreshes_the_cache(model_folders, measured, capsys):
    from verispec.cli import main

    args = ["costs", "--target", str(model_folders / "target"), "--draft", "ngram",
            "--k-max", "4"]
    for _ in range(2):
        assert main([*args, "--max-batch", "2"]) == 0
    assert measured == [("one-row", 1), ("batch", 2)] * 2  # afresh every time
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["verify_v"] == list(ONE_ROW.verify) and "2" in report["batches"]
    assert os.path.isfile(report["cached_in"])
    decoder = SpeculativeDecoder.from_pretrained(target=model_folders / "target", draft="ngram",
                                                 config=DecodeConfig(auto_k_max=4))
    assert decoder.costs == ONE_ROW and decoder.batch_costs(2) == BATCH
    assert len(measured) == 4  # read, not measured


def test_verispec_costs_without_a_draft_reports_no_draft_figures(model_folders, measured,
                                                                  capsys):
    """Plain decoding has no draft to price: its draft figures are null, not a measured 0."""
    from verispec.cli import main

    assert main(["costs", "--target", str(model_folders / "target"), "--draft", "none",
                 "--k-max", "4", "--max-batch", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["verify_v"] == list(ONE_ROW.verify) and report["target_step_ms"] > 0
    assert report["draft_step_c"] is None and report["draft_catch_up_ms_per_token"] is None
    assert report["draft_step_c_long"] is None
    assert report["batches"]["2"]["draft_step_c"] is None


def engine_measuring_with(measure_batch, model_file, monkeypatch, measure_after_idle_s: float):
    """(decoder, engine thread) of a tiny model with an n-gram drafter and k="auto", its one-row
    model given and its batch sizes measured by `measure_batch`, once idle that long."""
    from verispec.server.worker import EngineThread

    monkeypatch.setattr(table_module, "measure_costs", lambda *a, **k: ONE_ROW)
    monkeypatch.setattr(table_module, "measure_batch_costs", measure_batch)
    model = tiny_llama(EOS_ID + 1, seed=3, dtype=torch.float32)
    decoder = SpeculativeDecoder(model, None, NgramDrafter(), k="auto", runtime="native",
                                 model_files=[model_file])
    return decoder, EngineThread(decoder, max_batch=4,
                                 measure_after_idle_s=measure_after_idle_s)


def test_an_idle_engine_measures_and_a_request_interrupts_it(model_file, monkeypatch):
    """The engine measures the missing batch sizes while idle; a request that arrives stops
    the measurement (it asks between passes) and is served; the size is measured later."""
    from verispec.engine import Event

    started, attempts = threading.Event(), []

    def slow_batch(*args, batch, interrupt=None, **kwargs):
        attempts.append(batch)
        if len(attempts) == 1:  # the first attempt runs until something arrives
            started.set()
            while not interrupt():
                time.sleep(0.005)
            raise MeasurementInterrupted
        return BATCH

    decoder, engine = engine_measuring_with(slow_batch, model_file, monkeypatch, 0.05)

    async def serve_one() -> Event:
        engine.start()
        assert await asyncio.to_thread(started.wait, 30)
        handle = await engine.submit([5, 6, 7, 5, 6], SamplingParams(max_new_tokens=4,
                                                                    ignore_eos=True))
        while True:
            event = await handle.next()
            if event.output is not None:
                return event

    event = asyncio.run(serve_one())
    assert len(event.output.token_ids) == 4
    deadline = time.monotonic() + 30
    while decoder.cost_table.unmeasured(4) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert attempts == [2, 2, 4]  # interrupted, measured again when idle, then the next size
    assert table(decoder.target, model_file, decoder.drafter, decoder.config).unmeasured(4) == []


def test_an_engine_measures_only_after_a_quiet_spell(model_file, monkeypatch):
    """Requests sent one after another, each within the idle wait of the last, never find a
    measurement in their way: none starts until the engine has been idle that long."""
    attempts = []

    def batch(*args, batch, interrupt=None, **kwargs):
        attempts.append((batch, time.monotonic()))
        return BATCH

    _, engine = engine_measuring_with(batch, model_file, monkeypatch, 1.0)

    async def one_after_another() -> float:
        engine.start()
        for _ in range(5):
            await asyncio.sleep(0.3)
            submitted = time.monotonic()  # idle, at the earliest, from here
            handle = await engine.submit([5, 6, 7, 5, 6],
                                         SamplingParams(max_new_tokens=2, ignore_eos=True))
            while (await handle.next()).output is None:
                pass
        return submitted

    last = asyncio.run(one_after_another())
    assert attempts == []
    deadline = time.monotonic() + 30
    while len(attempts) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert [size for size, _ in attempts] == [2, 4]
    assert attempts[0][1] >= last + 1.0  # after the wait since the last request
