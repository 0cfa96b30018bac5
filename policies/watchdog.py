"""A watchdog for calls that may never return: a policy hook, a live run's loop.

A ``Watch`` marks when a watched call starts and ends (``seq`` odd while one runs: two
increments of an int per call, the only cost on the hot path; which thread runs it, and
what it is, are found only when its budget runs out). One daemon thread per process looks
at every watch a few times per budget; a call still running past its watch's ``budget_s``
gets the watch's error raised inside it:

* in the main thread, from a signal handler (``SIGNAL``, installed when the first watch is
  made in the main thread, if nothing else handles that signal): the signal also breaks a
  blocking call (``time.sleep``, a lock, a socket read), and the handler raises only if the
  call it was sent for is still running (the main thread itself moves ``seq``, so the
  check cannot race with the call returning);
* in any other thread, and where the signal is not ours, as an asynchronous exception
  (``PyThreadState_SetAsyncExc``): this ends Python code that loops, not a blocking call.

A call that catches the error and goes on gets ``OverrunKilled`` after another budget: a
BaseException, which ``except Exception`` does not catch (a bare ``except:`` still can). The error
is a subclass of the watch's exception, made when it fires, so it can say what ran over
(``locate``): ``PolicyStack`` raises a ``PolicyError`` naming the policy, the hook and the
request, found in the asking frame (``sys._current_frames``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType

# The signal the watchdog sends the main thread to interrupt a call past its budget. Not
# SIGALRM (test harnesses and pytest-timeout time out with it) nor SIGINT/SIGTERM.
SIGNAL = signal.SIGUSR2
# The watchdog looks at each watch this many times per budget (the error comes between
# budget and budget * (1 + 1/CHECKS) after the call started), at most every 50 ms and at
# least every second.
CHECKS = 4
MIN_PERIOD_S = 0.05
MAX_PERIOD_S = 1.0


class Overrun(Exception):
    """What a watch raises inside a call past its budget (each watch a subclass of its own):
    code between the call and the watch's owner lets it through unchanged."""

    message = "a watched call ran past its time budget"

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (self.message,)))


class OverrunKilled(BaseException):
    """What a watch raises the second time in the same call: the call caught its ``Overrun``
    (``except Exception``) and went on; this one only a bare ``except:`` catches. The owner
    of the watch turns it back into its own error (``overrun``, the watch's class)."""

    message = "a watched call ran past its time budget and caught the error it was sent"
    overrun: type[BaseException] = Overrun

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (self.message,)))


class Watch:
    """One kind of watched call, made in one thread at a time. ``seq += 1`` before and
    after the call marks it (odd while it runs); when its budget runs out, ``locate()`` says
    which thread runs it and what it is, as the error's message (None: it ended), so the hot
    path records nothing else. ``error`` is the exception class the error derives from."""

    __slots__ = ("__weakref__", "_seen", "_seen_at", "budget_s", "error", "fired", "fires", "ident", "locate", "seq")

    def __init__(self, budget_s: float, error: type[BaseException],
                 locate: Callable[[], tuple[int, str] | None]) -> None:
        self.budget_s = budget_s
        self.error = error
        self.locate = locate
        self.seq = 0  # odd while a call runs
        self.ident = 0  # the thread of the call the error was sent to
        self.fired = 0  # the seq of the call the error was sent for (0: none)
        self.fires = 0  # how often it was sent for that call
        self._seen = 0
        self._seen_at = 0.0
        _WATCHDOG.add(self)

    # ---- the watchdog's side -----------------------------------------------------------------
    def _check(self, now: float) -> None:
        seq = self.seq
        if not seq & 1:
            self._seen = 0
            return
        if seq != self._seen:
            self._seen, self._seen_at = seq, now
            return
        if now - self._seen_at >= self.budget_s:
            self._seen_at = now  # again after another budget, if the call goes on
            self._fire(seq)

    def _fire(self, seq: int) -> None:
        found = self.locate()
        if found is None:
            return  # it returned meanwhile
        self.ident, message = found
        self.fires = self.fires + 1 if self.fired == seq else 1
        if self.fires == 1:
            error: type[BaseException] = type(self.error.__name__, (self.error,), {"message": message})
        else:  # it caught the first one: one that `except Exception` does not catch
            error = type(OverrunKilled.__name__, (OverrunKilled,), {"message": message, "overrun": self.error})
        self.fired = seq
        if self.seq != seq:
            return  # it returned meanwhile
        if self.ident == threading.main_thread().ident and _WATCHDOG.signal_ours():
            _WATCHDOG.pending[self] = error
            signal.pthread_kill(self.ident, SIGNAL)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(error))


class _Watchdog:
    """The thread that looks at every live watch (one per process, started when needed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: weakref.WeakSet[Watch] = weakref.WeakSet()
        self.thread: threading.Thread | None = None
        # Errors to raise in the main thread's signal handler, by watch.
        self.pending: weakref.WeakKeyDictionary[Watch, type[BaseException]] = weakref.WeakKeyDictionary()
        self.installed = False
        self.wake = threading.Event()  # a new watch: look again now (its budget may be shorter)

    def add(self, watch: Watch) -> None:
        if threading.current_thread() is threading.main_thread():
            self._install()
        with self.lock:
            self.watches.add(watch)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="kvlife-watchdog", daemon=True)
                self.thread.start()
            else:
                self.wake.set()

    def _install(self) -> None:
        if not self.installed and signal.getsignal(SIGNAL) in (signal.SIG_DFL, None):
            signal.signal(SIGNAL, self._on_signal)
            self.installed = True

    def signal_ours(self) -> bool:
        return self.installed and signal.getsignal(SIGNAL) == self._on_signal

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """In the main thread: raise the error of a watch whose call is still the one it
        was sent for (``seq`` moves only in this thread: no race with the call ending)."""
        for watch, error in list(self.pending.items()):
            if watch.ident == threading.get_ident() and watch.seq == watch.fired and watch.seq & 1:
                del self.pending[watch]
                raise error()
            self.pending.pop(watch, None)

    def _run(self) -> None:
        while True:
            with self.lock:
                watches = list(self.watches)
                if not watches:
                    self.thread = None
                    return
            now = time.monotonic()
            period = min(MAX_PERIOD_S, max(MIN_PERIOD_S, min(w.budget_s for w in watches) / CHECKS))
            for watch in watches:
                watch._check(now)
            del watches
            self.wake.wait(period)
            self.wake.clear()

    def _after_fork(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = None


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._after_fork)
