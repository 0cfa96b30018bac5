"""The lifecycle spec's names as typed constants: states, triggers, finish reasons.

They live apart from ``specs/lifecycle.py`` (the python-statemachine class) so that the
engine imports them without python-statemachine, which a run does not need: it follows
the compiled table (``specs/table.py``). Tests check they are exactly the spec's.
"""

from __future__ import annotations

from enum import StrEnum

FINISH_REASONS = ("stopped", "length", "aborted", "error")
TERMINAL_STATE = "finished"
INITIAL_STATE = "waiting"


class RequestState(StrEnum):
    """The spec's states as typed names (a test checks they are exactly ``STATES``)."""

    WAITING = "waiting"
    LOOKUP_PENDING = "lookup_pending"
    LOADING = "loading"
    RUNNING = "running"
    SENDING = "sending"
    FINISHED = "finished"


class Trigger(StrEnum):
    """The spec's triggers as typed names (a test checks they are exactly the spec's events)."""

    LOOKUP_SUBMITTED = "lookup_submitted"
    LOOKUP_ANSWERED = "lookup_answered"
    LOOKUP_EXPIRED = "lookup_expired"
    LOAD_STARTED = "load_started"
    ADMITTED = "admitted"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    PREEMPTED = "preempted"
    TURN_ENDED = "turn_ended"
    SEND_STARTED = "send_started"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"
