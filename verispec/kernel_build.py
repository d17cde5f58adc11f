"""Building verispec's C++ kernels, and which of them may run.

Three families of kernels are compiled on first use with the system compiler, each cached:
- the native runtime's bfloat16 stack (runtime/native/kernels.cpp: a torch extension);
- the quantised kernels for GGUF weights, one module per instruction-set path
  (quant/kernels/: torch extensions);
- the chain verifier (verify/native.cpp: a plain shared library loaded with ctypes).

One builder serves them all: a build lands in `cache_folder("kernels", ...)` under a key made
of its sources (headers included), flags, the compiler's version and torch's, so a process never
loads a library built from other sources, and a changed compiler or torch rebuilds. A failed
build logs why and returns None: the caller falls back to PyTorch.

VERISPEC_KERNELS says which kernels may run, read by `kernel_setting()`:
    unset, 1 or auto   every kernel this CPU can run (AMX where it has it)
    0 or off           none: the PyTorch reference path everywhere
    avx512             no AMX (the bfloat16 stack on AVX512-BF16, the AVX-512 quantised path)
    avx2               as on an AVX2-only CPU: no bfloat16 stack, the AVX2 quantised path
    scalar             the portable quantised path only
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger("verispec")

# Instruction-set levels, narrowest first: a setting allows its level and those before it.
LEVELS = ("scalar", "avx2", "avx512", "amx")
_ALIASES = {"": "amx", "1": "amx", "auto": "amx", "on": "amx"}
_OFF = ("0", "off")


@dataclass(frozen=True, slots=True)
class KernelSetting:
    """What VERISPEC_KERNELS allows: nothing (enabled False), or kernels up to `ceiling`."""

    enabled: bool
    ceiling: str  # one of LEVELS

    def allows(self, level: str) -> bool:
        """Whether kernels of instruction-set level `level` may run."""
        return self.enabled and LEVELS.index(level) <= LEVELS.index(self.ceiling)


def kernel_setting() -> KernelSetting:
    """VERISPEC_KERNELS, parsed (read on every call: tests and users may change it). An unknown
    value is said once in the log and read as the default."""
    value = os.environ.get("VERISPEC_KERNELS", "").strip().lower()
    if value in _OFF:
        return KernelSetting(enabled=False, ceiling="scalar")
    value = _ALIASES.get(value, value)
    if value not in LEVELS:
        _warn_unknown(value)
        value = "amx"
    return KernelSetting(enabled=True, ceiling=value)


@functools.cache
def _warn_unknown(value: str) -> None:
    log.warning("VERISPEC_KERNELS=%s is not a setting (0, 1, %s); every kernel runs", value,
                ", ".join(LEVELS[:-1]))


def cache_folder(*parts: str) -> Path:
    """$XDG_CACHE_HOME/verispec/<parts> (by default ~/.cache/verispec/...), not created."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "verispec", *parts)


@functools.cache
def compiler_version(compiler: str) -> str:
    """The compiler's full version ("unknown" where it does not answer)."""
    try:
        done = subprocess.run([compiler, "-dumpfullversion", "-dumpversion"], check=True,
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_key(files: list[Path], flags: list[str], compiler: str, extra: str = "") -> str:
    """12 hex digits naming a build: the files' bytes, the flags, the compiler's version and
    `extra` (torch's version for torch extensions)."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*flags, compiler, compiler_version(compiler), extra]).encode())
    return digest.hexdigest()[:12]


# A compiler's or assembler's message line: "file:line[:column]: [fatal] error: ..."
_COMPILER_ERROR = re.compile(r":\d+(?::\d+)?: (?:fatal )?error:", re.IGNORECASE)


def _build_error(err: Exception) -> str:
    """What a failed build says went wrong: the compiler's first error where it printed one
    (a build tool's own last line, "ninja: build stopped", says nothing), else the last line."""
    detail = (getattr(err, "stderr", None) or str(err)).strip()
    if not detail:
        return type(err).__name__
    lines = detail.splitlines()
    return next((line.strip() for line in lines if _COMPILER_ERROR.search(line)), lines[-1])


def build_extension(name: str, sources: list[Path], headers: list[Path], cflags: list[str],
                    what: str) -> ModuleType | None:
    """A torch C++ extension `name` built from `sources` (which include `headers`), or None
    where it cannot be built (logged, naming `what`)."""
    import torch
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    key = build_key([*sources, *headers], cflags, compiler, f"torch {torch.__version__}")
    folder = cache_folder("kernels", f"{name}-{key}")
    if not folder.exists():
        _seed(folder, name)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{name}.so").exists():
        log.info("%s: building (once; cached in %s)", what, folder)
    began = time.perf_counter()
    try:
        with _held(folder / "build.lock"):
            # torch's own lock file: every load here holds ours first, so one found now was
            # left by a process that died mid-load (killed, or its node gone), and torch would
            # wait on it forever
            (folder / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name=name, sources=[str(path) for path in sources],
                                        build_directory=str(folder), extra_cflags=cflags,
                                        extra_ldflags=["-lgomp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the caller falls back
        log.warning("%s: could not build (%s); PyTorch runs instead", what, _build_error(err))
        return None
    if time.perf_counter() - began > 2:
        log.info("%s: built in %.0f s", what, time.perf_counter() - began)
    return module


@contextlib.contextmanager
def _held(path: Path):
    """An exclusive lock on `path` for the block: one process at a time builds or loads a
    folder's extension. The kernel releases it when its holder exits, however it exits."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _seed(folder: Path, name: str) -> None:
    """Start a new build folder as a copy of the newest earlier build of the same extension, so
    that ninja recompiles only the translation units whose sources changed (its dependency
    records and the files' times decide; anything it cannot match it rebuilds)."""
    earlier = [path for path in folder.parent.glob(f"{name}-*") if path.is_dir()]
    if not earlier:
        return
    newest = max(earlier, key=lambda path: path.stat().st_mtime)
    try:
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
            copy = Path(scratch) / "build"
            shutil.copytree(newest, copy,
                            ignore=shutil.ignore_patterns("lock", "build.lock", "*.so"))
            os.replace(copy, folder)
    except OSError:  # another process made it first, or the copy failed: build from scratch
        pass


def build_library(name: str, source: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """A plain shared library built from one C++ `source` (no torch headers) and loaded with
    ctypes, or None where it cannot be built (logged, naming `what`). Built beside its final
    name and renamed, so concurrent first uses never load half a file."""
    compiler = os.environ.get("CXX", "g++")
    flags = [*flags, "-fPIC", "-shared"]
    library = cache_folder("kernels", f"{name}-{build_key([source], flags, compiler)}.so")
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                built = Path(scratch) / library.name
                subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("%s: could not build (%s); PyTorch runs instead", what, _build_error(err))
        return None
