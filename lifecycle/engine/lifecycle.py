"""The primitives every part of the engine shares: record, move, ask, finish, release.

``Lifecycle`` works on the ``EngineState`` it is given and the policy stack. Every state
change of a request goes through ``move``: a lookup in the compiled spec table
(``kvlife.specs.table``), the state counts, and one ``transition`` record with its trigger
and reason. Every policy question goes through ``ask``, which records a ``decision`` when
the answer changes. ``finish`` takes a request to ``finished`` and gives its device blocks
back. The scheduler, the transfers and the event handlers of ``core.Engine`` all receive
the same ``Lifecycle``.
"""

from __future__ import annotations

from typing import Any

from kvlife.lifecycle.engine.events import DiscardLookup, FreeBlocks, SubmitLookup
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import EngineState
from kvlife.policies.stack import PolicyStack
from kvlife.specs.table import TABLE, ReferenceRequest

_EDGES = TABLE.edges  # (state, trigger) -> state


class Lifecycle:
    def __init__(self, state: EngineState, policies: PolicyStack) -> None:
        self.state = state
        self.policies = policies

    def record(self, record: dict[str, Any]) -> None:
        recorder = self.state.recorder
        if recorder is not None:
            recorder(record)

    def warn(self, what: str, **fields: Any) -> None:
        warnings = self.state.stats.warnings
        warnings[what] = warnings.get(what, 0) + 1
        self.record({"kind": "warning", "t": self.state.now, "what": what, **fields})

    def move(self, req: Request, trigger: str, reason: str) -> None:
        """Fire ``trigger`` on ``req``: its new state is the compiled table's, or
        ``IllegalTransition``. The hot path of the engine: keep it lean."""
        state = self.state
        source = req.state
        # The edge dict directly; an illegal move falls through to the table, which raises.
        target = _EDGES.get((source, trigger)) or TABLE.target(req.request_id, source, trigger)
        reference = state.reference
        if reference is not None:
            ref = reference.setdefault(req.request_id, ReferenceRequest(req.request_id))
            if ref.fire(trigger) != target:
                raise AssertionError(f"reference and table disagree on {req.request_id} {trigger}")
        req.state = target
        counts = state.state_counts
        counts[source] -= 1
        counts[target] += 1
        recorder = state.recorder
        if recorder is not None:
            recorder(
                {
                    "kind": "transition",
                    "t": state.now,
                    "req": req.request_id,
                    "from": source,
                    "to": target,
                    "trigger": trigger,
                    "reason": reason,
                }
            )

    def ask(self, req: Request, hook: str, *args: Any) -> Any:
        """The policy stack's answer at decision point ``hook``; a changed answer is recorded."""
        state = self.state
        answer = self.policies.ask(hook, req.view(), *args, state.engine_view())
        last = req.last_decisions.get(hook)
        current = (answer.policy, answer.value, answer.reason)
        if last != current:
            # Log a decision when it changes, not on every tick it is re-asked.
            req.last_decisions[hook] = current
            if hook == "admission" and answer.value == "defer":
                deferrals = state.stats.deferrals
                deferrals[answer.policy] = deferrals.get(answer.policy, 0) + 1
            self.record(
                {
                    "kind": "decision",
                    "t": state.now,
                    "req": req.request_id,
                    "point": hook,
                    "policy": answer.policy,
                    "value": answer.value,
                    "reason": answer.reason,
                }
            )
        return answer.value

    def submit_lookup(self, req: Request, reason: str) -> None:
        """Ask the driver for an async tier lookup; the request waits in ``lookup_pending``
        (in its place in the waiting queue: vLLM skips it until the answer comes).
        Idempotent: while one is pending for this epoch, a second is never submitted."""
        state = self.state
        if req.state == "lookup_pending":
            state.stats.duplicate_lookups += 1
            return
        state.sync_lookup_version.pop(req.request_id, None)
        state.stats.async_lookups += 1
        req.async_lookups += 1
        req.lookup = None
        req.lookup_submitted_ms = state.now
        state.lookup_timers.append((state.now + state.config.lookup_deadline_ms, req.request_id, req.async_lookups))
        state.commands.append(SubmitLookup(req.request_id, req.epoch, state.hit_candidates(req)))
        self.move(req, "lookup_submitted", reason)

    def expire_lookups(self) -> None:
        """Every async lookup still unanswered at its deadline (``lookup_deadline_ms`` after
        it went out, not before) is given up: the driver is told to discard it, the request
        goes back to ``waiting`` (``lookup_expired``) in a new epoch, so the answer, if it
        ever comes, is stale, and it goes on as a miss: no external hit this time (if it is
        not admitted, the next consideration looks up again, within ``engine.max_async_lookups``)."""
        state = self.state
        timers = state.lookup_timers
        now = state.now
        while timers and timers[0][0] <= now:
            due, rid, count = timers.popleft()
            req = state.requests.get(rid)
            if req is None or req.state != "lookup_pending" or req.async_lookups != count:
                continue  # answered, discarded or submitted again since
            state.stats.expired_lookups += 1
            state.commands.append(DiscardLookup(rid, req.epoch))
            state.wants_prefetch.pop(rid, None)  # an early prefetch needed that answer
            req.epoch += 1
            req.lookup = ()
            req.lookup_async = True
            req.lookup_answered_ms = now
            req.lookup_uses = 0
            self.move(req, "lookup_expired",
                      f"lookup deadline: no answer {now - req.lookup_submitted_ms:g} ms after it was submitted at "
                      f"t={req.lookup_submitted_ms:g} (deadline {state.config.lookup_deadline_ms:g} ms): "
                      f"treated as a miss; its answer is stale now")

    def finish(self, req: Request, trigger: str, reason: str, why: str) -> None:
        """Take ``req`` out of its queue, release its blocks and fire ``trigger`` (completed,
        failed or aborted); ``reason`` is the finish reason, ``why`` the transition's."""
        state = self.state
        if req in state.running:
            state.running.remove(req)
            state.drop_cohort_of(req)
        if req.state in ("waiting", "lookup_pending") and req in state.waiting:
            state.waiting.remove(req)
        elif req.state == "loading" and req in state.holding:
            state.holding.remove(req)
        self.release_request_blocks(req)
        req.epoch += 1
        req.finish_reason = reason
        if req.finish_ms is None or trigger != "completed":
            req.finish_ms = state.now
        self.move(req, trigger, why)

    def release_request_blocks(self, req: Request) -> None:
        """Drop the request's references on its device blocks (jobs keep their own)."""
        state = self.state
        if req.block_table:
            last = state.last_step_with(req) if state.defer_frees and state.steps else None
            if last is not None:
                # A step in flight still writes them: given back at its output.
                state.deferred_frees.setdefault(last, []).append(req.block_table)
            else:
                # Tail first, as vLLM frees a request's blocks: its prefix stays cached longest.
                freed = state.pool.release(reversed(req.block_table))
                if freed:
                    self.free_blocks(freed)
            req.block_table = []
        req.load_jobs = []

    def free_blocks(self, freed: list[int]) -> None:
        """Tell the driver (and the trace) that these device blocks hold nothing now."""
        self.record({"kind": "free", "t": self.state.now, "blocks": freed})
        self.state.commands.append(FreeBlocks(tuple(freed)))
