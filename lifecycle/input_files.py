"""Reading any file a user gives kvlife, bounded: one reader for every input.

Workloads, traces, config and profile files, grid specs, sweep results and calibration
CSVs all open through here, so each is held to the same bounds, and a file that breaks
one is one line naming it (and its line), never a hang or gigabytes of memory:

* **Regular files only.** A FIFO, a device, a socket or a directory is refused before it
  is read (opened without blocking, then checked): reading a FIFO would wait for a writer
  for ever, a device (``/dev/zero``) never ends.
* **Decompressed size.** A ``.gz`` file is decompressed as it is read, to at most
  ``GZIP_RATIO`` times its compressed size (and at least ``GZIP_FLOOR``): kvlife's own
  traces compress 9-18x and Mooncake workloads 4-5x (measured on the bundled and golden
  files), while gzip's format allows about 1,032x, which is what a gzip bomb uses.
* **Line length.** Lines are read up to a cap the caller derives from the input itself
  (a workload's block size bounds its hash ids; a trace's header bounds its records), so
  one line cannot take more memory than a well-formed one could.
* **Whole files** (TOML, CSV) are read up to a size cap.

Every refusal is an ``InputRefused``, an ``OSError`` whose ``strerror`` says why in a few
words, so the callers that already catch ``READ_ERRORS`` and name the file (and line)
report it unchanged; ``line`` is the line it stopped at, when there is one.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

# The most a .gz input may decompress to, per byte of its compressed size, and at least
# this much whatever its size (a small file of repeated lines compresses better).
GZIP_RATIO = 200
GZIP_FLOOR = 64 << 20
# Read in chunks of this size (lines are split from them, so no read takes a whole line).
CHUNK = 1 << 16
# A TOML or CSV file read whole: larger is no config, profile, grid spec or measurement
# table (the bundled profiles are under 2 KiB; a 200,000-row calibration CSV is 10 MiB).
TEXT_FILE_LIMIT = 64 << 20

# What opening or reading an input can raise besides a decode error of its content:
# OSError (a missing file, permissions, an InputRefused; gzip.BadGzipFile is one too),
# EOFError (a truncated gzip stream) and zlib.error (corrupt compressed data).
READ_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)


class InputRefused(OSError):
    """An input kvlife will not read: not a regular file, or past one of the bounds."""

    def __init__(self, message: str, line: int | None = None, code: int = errno.EINVAL) -> None:
        super().__init__(code, message)
        self.line = line


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _not_regular(mode: int) -> InputRefused:
    if stat.S_ISDIR(mode):
        return InputRefused(os.strerror(errno.EISDIR), code=errno.EISDIR)
    if stat.S_ISFIFO(mode):
        what = "a FIFO (named pipe): reading it would wait for a writer"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        what = "a device"
    elif stat.S_ISSOCK(mode):
        what = "a socket"
    else:
        what = "a special file"
    return InputRefused(f"not a regular file, {what}")


def check_regular(path: str | Path) -> None:
    """Refuse (``InputRefused``) a path that exists and is not a regular file, without
    opening it; for paths another library opens (a policy module). A missing path passes:
    the opener reports it in its own words."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(mode)


def open_regular(path: str | Path) -> io.BufferedReader:
    """Open a regular file for reading bytes; refuse anything else before a read could
    block (a FIFO is opened without blocking, then checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


class _CappedGzip(io.RawIOBase):
    """A gzip stream that refuses to decompress past ``limit`` bytes."""

    def __init__(self, raw: io.BufferedReader, compressed: int) -> None:
        self._gzip = gzip.GzipFile(fileobj=raw, mode="rb")
        self._raw = raw
        self.limit = max(GZIP_FLOOR, GZIP_RATIO * compressed)
        self._compressed = compressed
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = self._gzip.readinto(buffer)
        self.total += n
        if self.total > self.limit:
            raise InputRefused(f"a gzip file of {_size_text(self._compressed)} that decompresses to more than "
                               f"{_size_text(self.limit)} ({GZIP_RATIO}x its size; kvlife's traces compress "
                               f"under 20x): a gzip bomb?", code=errno.EFBIG)
        return n

    def close(self) -> None:
        try:
            self._gzip.close()
        finally:
            self._raw.close()
            super().close()


def open_input(path: str | Path) -> IO[bytes]:
    """Open an input for reading bytes: a regular file only; ``.gz`` decompressed on the
    fly, to at most ``GZIP_RATIO`` times its size."""
    raw = open_regular(path)
    if Path(path).suffix != ".gz":
        return raw
    try:
        compressed = os.fstat(raw.fileno()).st_size
    except BaseException:
        raw.close()
        raise
    return io.BufferedReader(_CappedGzip(raw, compressed), CHUNK)


class Lines:
    """The lines of an input, each at most ``max_line`` bytes (without its newline):
    iterate for (line number, line without ``\\r\\n``), blank lines counted but left out
    unless ``blank``. A longer
    line is an ``InputRefused`` naming its number, read no further than the cap.
    ``ended_with_newline`` says, once iterated, whether the last line had its newline
    (a trace cut mid-write has not). ``why`` says what the cap stands for."""

    def __init__(self, path: str | Path, max_line: int, why: str = "", blank: bool = False) -> None:
        self.path = path
        self.max_line = max_line
        self.why = why
        self.blank = blank  # yield blank lines too (every reader of kvlife skips them)
        self.ended_with_newline = True
        self.number = 0  # the last line yielded

    def set_max_line(self, max_line: int, why: str = "") -> None:
        """A new cap from here on (a trace's header bounds the lines after it)."""
        self.max_line = max_line
        self.why = why

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        with open_input(self.path) as stream:
            pending: list[bytes] = []  # the start of a line that spans chunks
            pending_size = 0
            number = 0
            while True:
                chunk = stream.read(CHUNK)
                if not chunk:
                    break
                if not pending and not self.blank and not chunk.strip():
                    # Only white space: blank lines, counted but not yielded (at C speed: a
                    # stream of newlines is a million lines a megabyte).
                    number += chunk.count(b"\n")
                    tail = chunk[chunk.rfind(b"\n") + 1:]
                    if tail:
                        pending.append(tail)
                        pending_size += len(tail)
                    continue
                parts = chunk.split(b"\n")
                tail = parts.pop()
                for part in parts:
                    number += 1
                    if pending:
                        part = b"".join((*pending, part))
                        pending.clear()
                        pending_size = 0
                    if len(part) > self.max_line + 1:  # (+1: a \r before the newline)
                        self._too_long(number)
                    self.number = number
                    if self.blank or part.strip():
                        yield number, part.rstrip(b"\r")
                if tail:
                    pending.append(tail)
                    pending_size += len(tail)
                    if pending_size > self.max_line + 1:
                        self._too_long(number + 1)
            self.ended_with_newline = not pending
            last = b"".join(pending)
            if pending and (self.blank or last.strip()):
                self.number = number + 1
                yield number + 1, last.rstrip(b"\r")

    def _too_long(self, number: int) -> None:
        why = f" ({self.why})" if self.why else ""
        raise InputRefused(f"a line longer than {_size_text(self.max_line)}{why}", line=number, code=errno.EFBIG)


def read_error_message(exc: BaseException) -> str:
    """Why an input could not be read, in a few words (no file name: the caller adds it)."""
    if isinstance(exc, EOFError):
        return "truncated gzip file (the compressed stream ends early)"
    if isinstance(exc, gzip.BadGzipFile | zlib.error):
        return f"corrupt gzip file ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def error_line(exc: BaseException, default: int | None) -> int | None:
    """The line an ``InputRefused`` stopped at, else ``default`` (the caller's count)."""
    line = getattr(exc, "line", None)
    return line if isinstance(line, int) else default


def read_limited(path: str | Path, limit: int = TEXT_FILE_LIMIT) -> bytes:
    """A whole (small) input's bytes: a regular file of at most ``limit`` bytes (after
    decompression, for a ``.gz``)."""
    with open_input(path) as stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise InputRefused(f"larger than {_size_text(limit)}: no config, profile, spec or table is that large",
                           code=errno.EFBIG)
    return data
