"""Ending a run on a signal: SIGTERM raises ``Terminated``, a ``KeyboardInterrupt``.

So Ctrl-C and ``kill`` take the same way out: every ``finally`` runs (rank threads stop,
the trace is closed), and the CLI exits 130 (SIGINT) or 143 (SIGTERM) with one line.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""

    signal_name = "SIGTERM"
    exit_code = 143


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def install_sigterm_handler() -> None:
    """Make SIGTERM raise ``Terminated`` in the main thread (a no-op in other threads)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
