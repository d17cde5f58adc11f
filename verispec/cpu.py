"""What this CPU can run, as the OS reports it (Linux's /proc/cpuinfo; elsewhere: nothing, so
the portable paths run). Which kernels run, and which weights a quantized GGUF file is run
with under the defaults, follow from these."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from verispec import kernel_build

# The flags that decide which kernels run (the checks below, and AMX for the bfloat16 stack).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "amx_tile", "amx_bf16")


@functools.cache
def _field(name: str) -> str | None:
    """The first /proc/cpuinfo line's value for `name` (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return None


@functools.cache
def flags() -> frozenset[str]:
    return frozenset((_field("flags") or "").split())


def vendor() -> str:
    """The CPU's vendor id, e.g. "GenuineIntel", "AuthenticAMD" ("" where it is not known)."""
    return _field("vendor_id") or ""


def model_name() -> str:
    """The CPU's model name, e.g. "AMD EPYC 9R14" (elsewhere: what Python knows)."""
    return _field("model name") or platform.processor() or platform.machine()


def kernel_flags() -> list[str]:
    """Which of KERNEL_FLAGS this CPU has, in that order."""
    return [flag for flag in KERNEL_FLAGS if flag in flags()]


def has_avx2() -> bool:
    """AVX2, FMA and F16C: the quantised kernels' AVX2 path."""
    return {"avx2", "fma", "f16c"} <= flags()


def has_avx512_vnni() -> bool:
    """AVX-512 F/BW/VL with VNNI (and AVX2, FMA, F16C): the quantised kernels' AVX-512 path."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags() and has_avx2()


def has_bf16() -> bool:
    """AVX512-BF16 (the flags the native kernels need beside it come with it on every such
    CPU; AMX CPUs have it too): the native runtime's C++ bfloat16 kernels."""
    return "avx512_bf16" in flags()


def kernels_enabled() -> bool:
    """Whether any of verispec's compiled kernels may run (VERISPEC_KERNELS, read by
    verispec.kernel_build)."""
    return kernel_build.kernel_setting().enabled


def runs_bf16_kernels() -> bool:
    """Whether the native runtime's C++ bfloat16 kernels run here: AVX512-BF16, and a
    VERISPEC_KERNELS setting that allows AVX-512."""
    return has_bf16() and kernel_build.kernel_setting().allows("avx512")
