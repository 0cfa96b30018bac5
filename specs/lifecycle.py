"""The request lifecycle: the one place where legal transitions are written down.

This python-statemachine class is the specification. The engine never runs it on its
hot path (one transition through the library costs ~150 us); instead
``kvlife.specs.table`` compiles it at import into a frozen transition table, and the
reference mode of the engine runs one instance of this class per request so a
Hypothesis test can prove the two agree.

python-statemachine validates the class when it is defined: every state reachable from
``waiting``, no trap states, ``finished`` reachable from every state.
"""

from __future__ import annotations

from statemachine import State, StateMachine

# The typed names live apart from the spec, so the engine imports them without python-statemachine.
from kvlife.specs.names import FINISH_REASONS, INITIAL_STATE, TERMINAL_STATE, RequestState, Trigger

__all__ = ["FINISH_REASONS", "INITIAL_STATE", "STATES", "TERMINAL_STATE", "RequestLifecycle", "RequestState", "Trigger"]



class RequestLifecycle(StateMachine):
    """States and transitions of one request (see DESIGN.md, "Request states")."""

    waiting = State(initial=True)
    lookup_pending = State()
    loading = State()
    running = State()
    sending = State()
    finished = State(final=True)

    # An async lookup went out; the request is not schedulable until it answers.
    lookup_submitted = waiting.to(lookup_pending)
    # The answer for this request's current epoch arrived (stale ones never get here).
    lookup_answered = lookup_pending.to(waiting)
    # No answer within ``engine.lookup_deadline_ms``: back in the queue as a miss, in a new
    # epoch, so the answer that may still come is stale.
    lookup_expired = lookup_pending.to(waiting)
    # Admitted with an external hit: device blocks allocated, a load job started.
    load_started = waiting.to(loading)
    # Admitted with nothing to load: scheduled for compute this tick.
    admitted = waiting.to(running)
    # Every rank reported the load and nothing failed.
    load_done = loading.to(running)
    # Every rank reported the load and some blocks failed, or the load was given up at its
    # transfer (or reclaim) deadline: recompute from the first bad block, which means
    # queueing again with a shorter hit.
    load_failed = loading.to(waiting)
    # Out of device blocks: back to the queue (vLLM frees its blocks; its in-flight stores
    # are finished before the next step writes anything).
    preempted = running.to(waiting)
    # A resumable request (vLLM's streaming input session) stopped its turn without finishing:
    # it keeps its blocks and computed tokens and waits for its next input chunk, which
    # admits it again (vLLM drops the turn's output still in flight: a new epoch).
    turn_ended = running.to(waiting)
    # Generation finished but a store or send still reads its blocks.
    send_started = running.to(sending)
    # Generation finished and nothing references its blocks any more; or (async
    # scheduling) a preempted request's in-flight token, which vLLM still delivers, was its
    # last one.
    completed = running.to(finished) | sending.to(finished) | waiting.to(finished)
    # The client went away. Blocks under an in-flight transfer stay held by that job
    # until every rank reported it; the request itself is done.
    aborted = (
        waiting.to(finished)
        | lookup_pending.to(finished)
        | loading.to(finished)
        | running.to(finished)
        | sending.to(finished)
    )
    # Unrecoverable: a load failed and the policy chose to fail the request, or a
    # request can never fit the device.
    failed = waiting.to(finished) | loading.to(finished) | running.to(finished) | sending.to(finished)


STATES: tuple[str, ...] = tuple(state.id for state in RequestLifecycle.states)
