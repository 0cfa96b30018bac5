"""Workloads that ship inside the package, by name, and opening any workload or trace file.

``mooncake-conversation`` is the conversation trace of Mooncake (FAST'25), Apache-2.0,
stored gzip-compressed in ``data/`` with its license and source. Anything ending in
``.gz`` is read as gzip, so a user's compressed traces work the same way.

Reading a ``.gz`` file can fail after it opened (a truncated or corrupt stream only shows
when its bytes are decompressed): callers catch ``READ_ERRORS`` around the whole read and
report ``read_error_message(exc)`` with the file name, as one line.
"""

from __future__ import annotations

import gzip
import io
import zlib
from importlib import resources
from pathlib import Path

# name -> file in this package's data/ folder
BUNDLED: dict[str, str] = {
    "mooncake-conversation": "mooncake-conversation.jsonl.gz",
}

# What opening or reading a (possibly gzip) file can raise besides a decode error of its
# content: OSError (missing file, permissions; gzip.BadGzipFile is one), EOFError (a
# truncated gzip stream) and zlib.error (corrupt compressed data).
READ_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)


def resolve_workload(name_or_path: str | Path) -> Path:
    """The file behind a bundled workload name, or the path itself."""
    name = str(name_or_path)
    if name in BUNDLED:
        return Path(str(resources.files("kvlife.lifecycle.workloads").joinpath("data", BUNDLED[name])))
    return Path(name_or_path)


def open_binary(path: str | Path) -> io.BufferedIOBase:
    """Open a workload or trace for reading bytes, decompressing ``.gz`` transparently."""
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rb")
    return open(p, "rb")  # noqa: SIM115 - the caller closes it


def read_error_message(exc: BaseException) -> str:
    """Why a file could not be read, in a few words (no file name: the caller adds it)."""
    if isinstance(exc, EOFError):
        return "truncated gzip file (the compressed stream ends early)"
    if isinstance(exc, gzip.BadGzipFile | zlib.error):
        return f"corrupt gzip file ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
