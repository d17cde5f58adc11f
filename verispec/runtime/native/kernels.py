"""verispec's C++ CPU kernels (kernels.cpp): bfloat16 linear layers and a whole decoder forward
in one call. Built with the system compiler on first use (~40 s, once per machine, torch version
and kernels.cpp), cached in $XDG_CACHE_HOME/verispec/kernels (by default
~/.cache/verispec/kernels), and used only where they can run: a CPU with AVX512-BF16 (products
on AMX tiles where it also has AMX, e.g. Sapphire Rapids; with VDPBF16PS otherwise, e.g. AMD
Zen 4 and later), bfloat16 weights. Everywhere else the runtime stays in PyTorch.

VERISPEC_KERNELS=0 turns them off (the PyTorch path, for comparison); VERISPEC_KERNELS=avx512
keeps AMX off where the CPU has it (the AVX512-BF16 path), read at the first load in a process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from verispec import cpu

log = logging.getLogger("verispec")

SOURCE = Path(__file__).with_name("kernels.cpp")  # includes its parts from kernels/*.h
PARTS = sorted(Path(__file__).with_name("kernels").glob("*.h"))


def _build_directory() -> Path:
    """One folder per torch version and kernel source (kernels.cpp and its parts): a process
    that has the library loaded never sees it rebuilt under it by another verispec version."""
    from verispec.loading import cache_root

    source = hashlib.sha256(b"".join(path.read_bytes() for path in [SOURCE, *PARTS]))
    source = source.hexdigest()[:12]
    folder = cache_root().parent / "kernels" / f"torch-{torch.__version__}-{source}"
    folder.mkdir(parents=True, exist_ok=True)  # beside models/
    return folder


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot run here (said once in the log). The
    module's `isa` says what its products run on: "amx" or "avx512-bf16"."""
    return _build() if cpu.kernels_enabled() else None


@functools.cache
def _build() -> ModuleType | None:
    if not cpu.has_bf16():
        log.info("native runtime: this CPU has no AVX512-BF16; the PyTorch path runs")
        return None
    from torch.utils import cpp_extension

    began = time.perf_counter()
    folder = _build_directory()
    if not (folder / "verispec_kernels.so").exists():
        log.info("native runtime: building verispec's C++ kernels (once, ~40 s)")
    try:
        module = cpp_extension.load(
            name="verispec_kernels", sources=[str(SOURCE)], build_directory=str(folder),
            extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-lgomp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the PyTorch path runs
        log.warning("native runtime: could not build the C++ kernels (%s); the PyTorch path runs",
                    str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return None
    module.isa = module.enable(os.environ.get("VERISPEC_KERNELS", "1") != "avx512")
    if not module.isa:
        log.warning("native runtime: the C++ kernels cannot run on this CPU; the PyTorch path runs")
        return None
    seconds = time.perf_counter() - began
    if seconds > 2:
        log.info("native runtime: built the C++ kernels in %.0f s (cached for next time)", seconds)
    log.info("native runtime: C++ kernels, products on %s", module.isa.upper())
    return module
