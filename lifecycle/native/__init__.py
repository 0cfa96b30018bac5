"""kvlife's native core: C++17 mirrors of the simulator's building blocks, built with pybind11.

The Python engine is the reference; every native piece is held to it by a differential
test that drives both with the same operations and compares what they return
(``tests/test_native_*.py``). ``setup.py`` builds ``_core`` from ``src/*.cpp``; where
that failed (no C++ compiler), ``why_not`` says why and everything runs in Python.
Importing this module never compiles anything and never fails.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

_ERROR_FILE = Path(__file__).with_name("_core_build_error.txt")


def load() -> ModuleType:
    """The compiled core; ``ImportError`` (saying why) where it was not built."""
    try:
        return importlib.import_module("kvlife.lifecycle.native._core")
    except ImportError as exc:
        raise ImportError(f"native core not built: {why_not() or exc}") from exc


def why_not() -> str | None:
    """None when the native core imports; else one line saying why it does not."""
    try:
        importlib.import_module("kvlife.lifecycle.native._core")
    except ImportError as exc:
        if _ERROR_FILE.is_file():
            return f"its build failed at install: {_ERROR_FILE.read_text().strip()}"
        return f"{exc} (reinstall kvlife with a C++17 compiler on PATH)"
    return None
