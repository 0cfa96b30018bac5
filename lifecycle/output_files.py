"""Writing every file kvlife produces, so that nothing already there is lost.

Every output (a trace, a plot, a Perfetto export, sweep results, a calibrated profile, a
fidelity report, a profiling CSV) is written to a temporary file beside its destination
(``.NAME.RANDOM.tmpSUFFIX``, created exclusively, with the permissions a plain ``open``
would give) and renamed over the destination only when it is complete: a run refused
half-way, an error or a crash never leaves a half-written file where a good one was.

* ``PendingOutput``: the temporary file and its three endings: ``commit`` (rename over the
  destination), ``commit_if_absent`` (rename only where no file is: a run refused part-way
  keeps what it wrote without replacing anything) and ``discard``.
* ``atomic_output`` / ``write_output``: the usual case, committed on success and discarded
  on any exception.
* ``check_output``: an output may not be one of the command's inputs (``kvlife export
  t.jsonl --perfetto t.jsonl`` would overwrite the trace it reads), nor a directory.

A refusal is an ``OutputError`` (a ``UsageError``): one line naming the file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from kvlife.lifecycle.cli.parsing import UsageError


class OutputError(UsageError):
    """An output kvlife will not write: ``FILE: message``, one line naming the command, as a
    bad flag value is (``kvlife export: error: t.jsonl: cannot write: ...``)."""

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def same_file(a: str | Path, b: str | Path) -> bool:
    """Do two paths name the same file (the same inode when both exist, else the same
    absolute path)?"""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_output(path: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse an output that is one of ``inputs`` or a directory."""
    for source in inputs:
        if source is not None and same_file(path, source):
            raise OutputError(path, f"cannot write: it is an input of this command ({source}); "
                                    f"writing it would destroy what is being read")
    if os.path.isdir(path):
        raise OutputError(path, "cannot write: it is a directory")


class PendingOutput:
    """A temporary file beside ``path``, to become ``path`` once complete."""

    def __init__(self, path: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
        self.path = Path(path)
        check_output(self.path, inputs)
        parent = self.path.parent
        suffix = self.path.suffix
        self.temp = parent / f".{self.path.name}.{secrets.token_hex(4)}.tmp{suffix}"
        try:
            # O_EXCL: never one another process made; 0o666 less the umask, as open() gives.
            fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise OutputError(self.path, f"cannot write: {exc.strerror or exc}") from None
        os.close(fd)
        self.done = False

    def open(self) -> IO[bytes]:
        return open(self.temp, "wb")  # noqa: SIM115 - the caller closes it

    def commit(self) -> None:
        """The temporary file becomes the destination (replacing what was there)."""
        if self.done:
            return
        try:
            os.replace(self.temp, self.path)
        except OSError as exc:
            self.discard()
            raise OutputError(self.path, f"cannot write: {exc.strerror or exc}") from None
        self.done = True

    def commit_if_absent(self) -> bool:
        """The temporary file becomes the destination only if there is none; else it is
        removed. Returns whether it was kept."""
        if self.done:
            return False
        try:
            os.link(self.temp, self.path)  # fails where a file is: nothing is replaced
        except FileExistsError:
            self.discard()
            return False
        except OSError:  # a file system without hard links: the same, not atomically
            if self.path.exists():
                self.discard()
                return False
            os.replace(self.temp, self.path)
            self.done = True
            return True
        self.discard()
        self.done = True
        return True

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.temp)
        self.done = True


@contextlib.contextmanager
def atomic_output(path: str | Path, inputs: Iterable[str | Path | None] = ()) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to (its suffix kept, so a library
    that picks a format by the name picks the same one); renamed over ``path`` when the
    block ends normally, removed on any exception."""
    pending = PendingOutput(path, inputs)
    try:
        yield pending.temp
    except BaseException:
        pending.discard()
        raise
    pending.commit()


def write_output(path: str | Path, data: bytes, inputs: Iterable[str | Path | None] = ()) -> None:
    """Write ``data`` to ``path`` through a temporary file (``atomic_output``)."""
    with atomic_output(path, inputs) as temp:
        temp.write_bytes(data)
