"""Workloads that ship inside the package, by name, and opening any workload or trace file.

``mooncake-conversation`` is the conversation trace of Mooncake (FAST'25), Apache-2.0,
stored gzip-compressed in ``data/`` with its license and source. Anything ending in
``.gz`` is read as gzip, so a user's compressed traces work the same way.
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path
from typing import IO

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


def open_binary(path: str | Path) -> IO[bytes]:
    """Open a workload or trace for reading bytes, decompressing ``.gz`` transparently."""
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rb")
    return open(p, "rb")  # noqa: SIM115 - the caller closes it
