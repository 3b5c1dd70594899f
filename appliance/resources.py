"""Finding files shipped with the appliance, the same way from a source tree and from the one-file executable.

Policy: bundled files keep their package-relative paths. In a source tree they sit next to the modules of
the `appliance` package; in the PyInstaller one-file executable they are unpacked under sys._MEIPASS with
the same relative layout (build/pyinstaller.spec puts them there). Callers ask by package-relative path
and never look at sys._MEIPASS themselves.
"""
from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def is_frozen() -> bool:
    """True inside the PyInstaller executable."""
    return bool(getattr(sys, "frozen", False)) and hasattr(sys, "_MEIPASS")


def package_dir() -> str:
    """The directory that holds the `appliance` package's bundled files."""
    if is_frozen():
        return os.path.join(sys._MEIPASS, "appliance")  # type: ignore[attr-defined]
    return _PACKAGE_DIR


def resource_path(*parts: str) -> str:
    """Absolute path of a bundled file given relative to the package, e.g. ("native", "libkestrel.so")."""
    return os.path.join(package_dir(), *parts)


def find_resource(*parts: str) -> str | None:
    """resource_path(), or None when that file is not there (e.g. the native library was not compiled)."""
    path = resource_path(*parts)
    return path if os.path.exists(path) else None
