"""Ending a run on Ctrl-C or SIGTERM, cleanly.

Both signals end a run the same way: the driver stops between two engine calls, writes a
final ``interrupted`` record (the engine's time, the signal, the work still open), closes
the trace, shuts its runtime down and re-raises. The command line then exits 130 (SIGINT)
or 143 (SIGTERM) with one line.

- ``Terminated`` is the KeyboardInterrupt SIGTERM raises once ``install_sigterm_handler``
  ran; ``Interrupted`` the one SIGINT raises once ``install_sigint_handler`` ran (the command
  line installs both); a plain KeyboardInterrupt is SIGINT too. Both carry ``from_signal``:
  a policy hook that raises KeyboardInterrupt itself is a policy error, not an interrupt
  (``kvlife.policies.stack.PolicyStack.ask`` tells them apart by it).
- ``held()`` holds both signals while a driver runs: a signal that would raise anywhere
  (in the middle of an engine call, half-way through a trace line) is kept instead, and
  the driver raises it at its next ``gate.check()``, between engine calls, so the trace
  stops at a handling boundary. A second signal while one is held raises at once: the
  user insists. Only signals whose handler would raise anyway are held (SIGINT with
  Python's default handler, SIGTERM with ours); ignored ones stay ignored. Outside the
  main thread signals cannot be handled: the gate is inert there.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as a KeyboardInterrupt so that everything that cleans up after a
    Ctrl-C cleans up after it too."""

    signal_name = "SIGTERM"
    exit_code = 143
    from_signal = True


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) as kvlife's handler raises it: marked as coming from the signal."""

    signal_name = "SIGINT"
    exit_code = 130
    from_signal = True


def signal_name(exc: BaseException) -> str:
    """"SIGTERM" for ``Terminated``, "SIGINT" for any other KeyboardInterrupt."""
    return str(getattr(exc, "signal_name", "SIGINT"))


def exit_code(exc: BaseException) -> int:
    """128 + the signal number: 143 for SIGTERM, 130 for SIGINT."""
    return int(getattr(exc, "exit_code", 130))


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def install_sigterm_handler() -> None:
    """SIGTERM raises ``Terminated`` (main thread only; elsewhere this does nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted()


def install_sigint_handler() -> None:
    """SIGINT raises ``Interrupted`` where it would raise a KeyboardInterrupt anyway (Python's
    default handler; an ignored SIGINT stays ignored). Main thread only."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupted)


_Handler = Callable[[int, FrameType | None], Any] | int | None


class StopGate:
    """Signals held until ``check()``; see the module docstring."""

    # (slots: the native loop reads ``pending`` between every two events, in place)
    __slots__ = ("_previous", "clean", "pending")

    def __init__(self) -> None:
        self.pending: KeyboardInterrupt | None = None
        # True once check() raised: the run stopped between engine calls, not inside one.
        self.clean = False
        self._previous: dict[int, _Handler] = {}

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is not None:
            raise self.pending  # a second signal: stop now, wherever we are
        self.pending = Terminated() if signum == signal.SIGTERM else Interrupted()

    def check(self) -> None:
        """Raise the held signal, if any. Call it between engine calls."""
        if self.pending is not None:
            self.clean = True
            raise self.pending

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        raising = {signal.SIGINT: (signal.default_int_handler, _raise_interrupted),
                   signal.SIGTERM: (_raise_terminated,)}
        for signum, handlers in raising.items():
            current = signal.getsignal(signum)
            if current in handlers:
                self._previous[signum] = current
                signal.signal(signum, self._hold)
        return bool(self._previous)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


_active: StopGate | None = None


@contextmanager
def held() -> Iterator[StopGate]:
    """Hold SIGINT/SIGTERM for the duration; nested uses share the outermost gate. A signal
    still held when the block ends normally is raised then (the run is complete, but the
    user asked to stop)."""
    global _active
    if _active is not None and threading.current_thread() is threading.main_thread():
        yield _active
        return
    gate = StopGate()
    if not gate.install():
        yield gate  # not the main thread, or nothing to hold: signals act as they would
        return
    _active = gate
    try:
        yield gate
    finally:
        gate.uninstall()
        _active = None
    gate.check()
