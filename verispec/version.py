"""verispec's version: the one pyproject.toml gives, as installed (no import of the package
root, so any module may ask)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def installed_version() -> str:
    """The installed distribution's version; "unknown" when verispec runs uninstalled."""
    try:
        return version("verispec")
    except PackageNotFoundError:
        return "unknown"
