"""What produced a benchmark record: the machine, the commit and the command line.

A speedup means nothing without them: the same commit runs the C++ kernels on one CPU and the
PyTorch path on another, and a ratio moves with the code. Every record the bench writes carries

    {"cpu": {"model", "logical_cpus", "usable_cpus", "isa": {flag: bool}, "kernel_path"},
     "commit": {"sha", "dirty", "version"}, "command", "recorded_at"}

`kernel_path` is what the CPU's flags allow ("amx", "avx512-bf16" or "none": the PyTorch path);
what actually ran (kernels can be switched off, or fail to build) is the runner's own
description, which the bench records beside it.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

# The instruction sets verispec's code paths depend on, per architecture: the C++ kernels need
# AVX512-BF16 (and use AMX tiles where the CPU has them); the PyTorch path's speed on x86 rides
# on AVX2/FMA/F16C through oneDNN; ARM's bf16 and SVE decide what PyTorch can do there.
X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
ARM_FLAGS = ("asimd", "sve", "bf16", "i8mm")

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the verispec package


def provenance(argv: list[str] | None = None) -> dict:
    """The record of this process: machine, commit, command line, time."""
    return dict(cpu=cpu_info(), commit=git_commit(SOURCE_ROOT),
                command=command_line(sys.argv if argv is None else argv),
                recorded_at=datetime.now(UTC).isoformat(timespec="seconds"))


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU's model name, core counts and ISA flags. `cpuinfo`: the text of /proc/cpuinfo
    (read from the machine when None; elsewhere the flags stay unknown).

    >>> cpu_info("model name : AMD EPYC\\nflags : fpu avx2 fma f16c\\n")["kernel_path"]
    'none'
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = _first_fields(cpuinfo)
    if "flags" in fields:
        present, known = set(fields["flags"].split()), X86_FLAGS
    elif "Features" in fields:
        present, known = set(fields["Features"].split()), ARM_FLAGS
    else:
        present, known = set(), ()
    isa = {flag: flag in present for flag in known}
    return dict(model=fields.get("model name") or _platform_cpu_model(),
                logical_cpus=os.cpu_count(), usable_cpus=_usable_cpus(), isa=isa,
                kernel_path=kernel_path(isa))


def kernel_path(isa: dict[str, bool]) -> str:
    """Which of verispec's C++ kernel paths these flags allow (the kernels' own rule:
    verispec/runtime/native/bf16_kernels.py)."""
    if not isa.get("avx512_bf16"):
        return "none"
    return "amx" if isa.get("amx_tile") and isa.get("amx_bf16") else "avx512-bf16"


def git_commit(root: Path) -> dict:
    """The commit of the source tree at `root` and whether it differs from it (uncommitted or
    untracked files). sha and dirty are None where `root` is not the top of a git checkout: an
    installed package inside some other repository must not report that repository's commit."""
    try:
        version = metadata.version("verispec")
    except metadata.PackageNotFoundError:
        version = None
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        return dict(sha=None, dirty=None, version=version)
    status = _git(root, "status", "--porcelain")
    return dict(sha=_git(root, "rev-parse", "HEAD"),
                dirty=None if status is None else bool(status), version=version)


def command_line(argv: list[str]) -> str:
    """argv as a shell would take it back, the program by its name rather than its path.

    >>> command_line(["/usr/bin/verispec", "bench", "--methods", "baseline,ngram", "--out", "a b"])
    "verispec bench --methods baseline,ngram --out 'a b'"
    """
    if not argv:
        return ""
    return shlex.join([Path(argv[0]).name, *argv[1:]])


def markdown_lines(record: dict) -> list[str]:
    """The record as the lines that head a report."""
    cpu, commit = record["cpu"], record["commit"]
    has = [flag for flag, present in cpu["isa"].items() if present]
    lacks = [flag for flag, present in cpu["isa"].items() if not present]
    flags = " ".join(has) + (f" (not: {' '.join(lacks)})" if lacks else "")
    kernels = {"amx": "C++ kernels on AMX", "avx512-bf16": "C++ kernels on AVX512-BF16",
               "none": "none (the PyTorch path)"}[cpu["kernel_path"]]
    if commit["sha"] is None:
        source = f"not a git checkout (verispec {commit['version']})"
    else:
        source = (f"`{commit['sha']}`" + (" with uncommitted changes" if commit["dirty"] else "")
                  + f" (verispec {commit['version']})")
    return [f"- Machine: {cpu['model']}, {cpu['logical_cpus']} logical CPUs "
            f"({cpu['usable_cpus']} usable); ISA: {flags.strip() or 'unknown'}; native kernels "
            f"this CPU allows: {kernels}",
            f"- Commit: {source}",
            f"- Command: `{record['command']}`",
            f"- Recorded: {record['recorded_at']}"]


def _first_fields(cpuinfo: str) -> dict[str, str]:
    """`key : value` lines of the first processor block (every core lists the same flags)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _platform_cpu_model() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=5,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS or Windows
        return os.cpu_count()


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return None
    return done.stdout.strip() if done.returncode == 0 else None
