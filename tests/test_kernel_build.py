"""The one builder of verispec's C++ kernels and the one reading of VERISPEC_KERNELS."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import cpu, kernel_build
from verispec.quant import quant_kernels
from verispec.runtime.native import bf16_kernels as native_kernels


@pytest.mark.parametrize(("value", "enabled", "allowed"), [
    (None, True, {"scalar", "avx2", "avx512", "amx"}),
    ("1", True, {"scalar", "avx2", "avx512", "amx"}),
    ("0", False, set()),
    ("off", False, set()),
    ("avx512", True, {"scalar", "avx2", "avx512"}),
    ("AVX2", True, {"scalar", "avx2"}),
    ("scalar", True, {"scalar"}),
])
def test_the_setting_allows_its_level_and_those_below(monkeypatch, value, enabled, allowed):
    if value is None:
        monkeypatch.delenv("VERISPEC_KERNELS", raising=False)
    else:
        monkeypatch.setenv("VERISPEC_KERNELS", value)
    setting = kernel_build.kernel_setting()
    assert setting.enabled is enabled
    assert {level for level in kernel_build.LEVELS if setting.allows(level)} == allowed
    assert cpu.kernels_enabled() is enabled


def test_an_unknown_setting_is_said_and_read_as_the_default(monkeypatch, caplog):
    monkeypatch.setenv("VERISPEC_KERNELS", "avx1024")
    with caplog.at_level(logging.WARNING, logger="verispec"):
        setting = kernel_build.kernel_setting()
    assert setting == kernel_build.KernelSetting(enabled=True, ceiling="amx")
    assert "VERISPEC_KERNELS=avx1024 is not a setting" in caplog.text


def test_held_to_avx2_no_avx512_kernel_runs(monkeypatch):
    """VERISPEC_KERNELS=avx2 runs what an AVX2-only CPU runs: no bfloat16 stack."""
    monkeypatch.setenv("VERISPEC_KERNELS", "avx2")
    assert not cpu.runs_bf16_kernels()
    assert native_kernels.load() is None


def test_the_key_names_sources_flags_and_compiler(tmp_path):
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    key = kernel_build.build_key([source], ["-O3"], "g++")
    assert key == kernel_build.build_key([source], ["-O3"], "g++")
    assert key != kernel_build.build_key([source], ["-O2"], "g++")
    assert key != kernel_build.build_key([source], ["-O3"], "g++", "torch 0.0")
    source.write_text("int f() { return 2; }\n")
    assert key != kernel_build.build_key([source], ["-O3"], "g++")


def test_a_library_is_built_once_and_a_failed_build_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    good = tmp_path / "good.cpp"
    good.write_text('extern "C" int answer() { return 42; }\n')
    library = kernel_build.build_library("good", good, ["-O1"], "a test library")
    assert library is not None and library.answer() == 42
    built = list((tmp_path / "cache" / "verispec" / "kernels").glob("good-*.so"))
    assert len(built) == 1
    # the same source again: the cached file, not a second build
    assert kernel_build.build_library("good", good, ["-O1"], "a test library") is not None
    assert list((tmp_path / "cache" / "verispec" / "kernels").glob("good-*.so")) == built
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="verispec"):
        assert kernel_build.build_library("bad", bad, ["-O1"], "a broken library") is None
    assert "a broken library: could not build" in caplog.text
    # the log names the compiler's error, not the build tool's last word
    assert "bad.cpp:1" in caplog.text and "error:" in caplog.text


def test_nothing_is_built_when_the_kernels_are_off(monkeypatch):
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    monkeypatch.setattr(kernel_build, "build_extension", pytest.fail)
    monkeypatch.setattr(kernel_build, "build_library", pytest.fail)
    quant_kernels._active.cache_clear()
    try:
        assert quant_kernels._active() == ("off", None)
    finally:
        quant_kernels._active.cache_clear()
    assert native_kernels.load() is None


def test_a_lock_left_by_a_killed_load_does_not_stop_the_next(tmp_path):
    """A process killed while torch held a build folder's lock file (a replica stopped as it
    started, its node gone) leaves the file behind; the next process loads all the same
    instead of waiting for it forever."""
    module = quant_kernels.compiled()
    if module is None:
        pytest.skip("verispec.quant.quant_kernels is not built here")
    built = Path(module.__file__).parent
    folder = tmp_path / "verispec" / "kernels" / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*lock"))
    (folder / "lock").touch()  # torch's lock file, as a load killed halfway leaves it
    code = ("import sys; from verispec.quant import quant_kernels; "
            "sys.exit(quant_kernels.compiled() is None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path),
                                            "VERISPEC_KERNELS": module.path})
    assert done.returncode == 0, done.stderr
    assert not (folder / "lock").exists()


def test_a_failed_build_is_reported_by_its_first_compiler_error():
    ninja = RuntimeError("Error building extension 'k': [1/2] c++ -c a.cpp -o a.o\n"
                         "FAILED: a.o\n"
                         "/src/a.h:94: Error: bad register name `%tmmkB'\n"
                         "/src/a.h:95: Error: bad register name `%tmmkA'\n"
                         "ninja: build stopped: subcommand failed.")
    assert kernel_build._build_error(ninja) == "/src/a.h:94: Error: bad register name `%tmmkB'"
    # nothing a compiler printed: the last line, or the error's kind
    assert kernel_build._build_error(OSError("no such file: ninja")) == "no such file: ninja"
    assert kernel_build._build_error(RuntimeError("")) == "RuntimeError"


def test_every_kernel_this_cpu_runs_builds_where_the_tools_are(caplog):
    """Where a C++ compiler and ninja are present, each kernel family this CPU runs (and the
    setting allows) builds. The kernel tests skip a path that does not build, so without this
    a compile error would pass the suite with only the PyTorch path tested."""
    from torch.utils import cpp_extension

    from verispec.verify import native as verify_native
    if shutil.which(os.environ.get("CXX", "c++")) is None \
            or not cpp_extension.is_ninja_available():
        pytest.skip("no C++ compiler or no ninja here")
    setting = kernel_build.kernel_setting()
    caplog.set_level(logging.WARNING, logger="verispec")
    failed = [path for path in ("scalar", "avx2", "avx512")
              if setting.allows(path) and quant_kernels.RUNS_HERE[path]()
              and quant_kernels.load(path) is None]
    if setting.allows("avx512") and cpu.has_bf16() and native_kernels.load() is None:
        failed.append("bf16 stack")
    if setting.enabled and verify_native.load() is None:
        failed.append("chain verifier")
    assert not failed, f"{failed} did not build: {caplog.text}"
