"""Workloads that ship inside the package, by name.

``mooncake-conversation`` is the conversation trace of Mooncake (FAST'25), Apache-2.0,
stored gzip-compressed in ``data/`` with its license and source. Any file, bundled or
not, is opened through ``kvlife.lifecycle.input_files`` (regular files only, ``.gz`` read
as gzip within its bounds).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# name -> file in this package's data/ folder
BUNDLED: dict[str, str] = {
    "mooncake-conversation": "mooncake-conversation.jsonl.gz",
}


def resolve_workload(name_or_path: str | Path) -> Path:
    """The file behind a bundled workload name, or the path itself."""
    name = str(name_or_path)
    if name in BUNDLED:
        return Path(str(resources.files("kvlife.lifecycle.workloads").joinpath("data", BUNDLED[name])))
    return Path(name_or_path)
