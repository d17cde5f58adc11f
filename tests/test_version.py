"""One version: pyproject.toml's, as `verispec --version`, `verispec.__version__` and the caches'
keys read it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import verispec

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_cli_and_the_package_report_pyprojects_version():
    expected = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "verispec.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"verispec {expected}"
    assert verispec.__version__ == expected
