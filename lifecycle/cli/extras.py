"""Optional extras (``kvlife[live]``, ``kvlife[plot]``): one line naming the extra, exit 2.

Simulation, traces, replay, validate and check never import torch, redis or matplotlib;
a command that needs one calls ``require`` before importing the code that uses it.
"""

from __future__ import annotations

import importlib

from kvlife.lifecycle.cli.parsing import UsageError

# Optional dependencies -> the extra that installs them (pyproject.toml).
OPTIONAL_EXTRAS = {"torch": "live", "redis": "live", "numpy": "live", "matplotlib": "plot", "ray": "ray"}


class MissingExtra(UsageError):
    """``kvlife plot needs matplotlib: pip install 'kvlife[plot]'``."""


def require(module: str, extra: str, command: str) -> None:
    """Import ``module`` or raise MissingExtra naming ``command`` and the extra to install."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{command} needs {module}: pip install 'kvlife[{extra}]'") from None
