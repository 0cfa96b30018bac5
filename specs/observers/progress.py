"""Invariant 7, progress: a preemption makes room at once.

vLLM preempts a running request to make room for another (``_preempt_request``): the
victim's blocks go back at once, and the allocation it was preempted for is tried again.
Under async scheduling with a connector vLLM defers freeing a block that a step in flight
still writes (``defer_block_free``), so its scheduler does not take a victim that a step in
flight still computes (``_request_blocks_can_be_freed``, the fix of vllm#49674). An engine
that does take one preempts for nothing: its blocks come back only at that step's output,
the allocation fails again, and one failed allocation cascades across victim after victim,
each set back to recompute while no room was made (4 preemptions became 2,099 on a stress
run).

So, live (the step plans name every request they schedule) under async scheduling: a
request preempted by a scheduler pass is scheduled by no step in flight (planned, its
output not delivered) in its current epoch. Preemptions outside a pass (vLLM's
``reset_prefix_cache`` takes every running request, whatever its steps in flight) are not
judged. A trace's steps name only their prompt chunks and fills, not every decode, so
``kvlife validate`` cannot tell which steps in flight compute a victim: it does not judge
this rule (it says so among what it did not check).
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer


class Progress(Observer):
    invariants = (7,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.judged = ctx.settings.live and ctx.settings.async_scheduling

    def on_transition(self, ev: Event) -> None:
        req = ev.req
        if not self.judged or req is None or ev.get("trigger") != "preempted" or not self.picture.input_is("tick"):
            return
        for step in self.picture.steps.values():
            if any(e.rid == req.rid and e.epoch == req.epoch for e in step.entries):
                self.fail(7, f"{req.rid} preempted while step {step.step_id}, whose output has not come, still "
                             f"computes it: its blocks go back only at that output, so the preemption makes no "
                             f"room now (a zero-progress preemption cascade, vllm#49674)")
                return
