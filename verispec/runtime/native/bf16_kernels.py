"""verispec's C++ CPU kernels (kernels.cpp): bfloat16 linear layers and a whole decoder forward
in one call. Built with the system compiler on first use (~40 s, once per machine, torch version
and source; verispec.kernel_build), and used only where they can run: a CPU with AVX512-BF16
(products on AMX tiles where it also has AMX, e.g. Sapphire Rapids; with VDPBF16PS otherwise,
e.g. AMD Zen 4 and later), bfloat16 weights. Everywhere else the runtime stays in PyTorch.

VERISPEC_KERNELS=0 turns them off (the PyTorch path, for comparison); =avx512 keeps AMX off where
the CPU has it (the AVX512-BF16 path); =avx2 or =scalar turn them off as on a CPU without
AVX-512 (see verispec.kernel_build).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from verispec import cpu, kernel_build

log = logging.getLogger("verispec")

SOURCE = Path(__file__).with_name("kernels.cpp")  # includes its parts from kernels/*.h
PARTS = sorted(Path(__file__).with_name("kernels").glob("*.h"))


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot run here (said once in the log). The
    module's `isa` says what its products run on: "amx" or "avx512-bf16"."""
    setting = kernel_build.kernel_setting()
    return _build(setting.allows("amx")) if setting.allows("avx512") else None


@functools.cache
def _build(allow_amx: bool) -> ModuleType | None:
    if not cpu.has_bf16():
        log.info("native runtime: this CPU has no AVX512-BF16; the PyTorch path runs")
        return None
    module = kernel_build.build_extension("verispec_kernels", [SOURCE], PARTS,
                                          ["-O3", "-fopenmp"], "native runtime: C++ kernels")
    if module is None:
        return None
    isa = module.enable(allow_amx)
    if not isa:
        log.warning("native runtime: the C++ kernels cannot run on this CPU; the PyTorch path runs")
        return None
    module.isa = isa
    log.info("native runtime: C++ kernels, products on %s", isa.upper())
    return module
