"""Invariant 11, the steps: what one step may schedule.

Each step respects the token budget (``max_batched_tokens``) and, at the end of every
handling, no more than ``max_running`` requests run. A step gives every request it names
at least one token, never a position past its last input (prompt + ``max_tokens`` - 1:
the last sampled token is never an input) and, live, never past the tokens the request
has: its prompt, the tokens delivered to it and those sampled by its steps in flight
(output placeholders). Live, it names the block hashes of every block it fills.

Work conservation (live): a step that leaves budget unused leaves out no running request
that has tokens to compute, needs no new block for them and has not sampled its last
token. A pass with a preemption or a failure may be cut short; it is not judged.
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer, cdiv
from kvlife.specs.observers.picture import Entry, Req, Step


class Steps(Observer):
    invariants = (11,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.running = 0
        self.cut_short = False  # this tick's pass saw a preemption or a failure

    def on_tick(self, ev: Event) -> None:
        self.cut_short = False

    def on_transition(self, ev: Event) -> None:
        trigger, target = ev.get("trigger"), ev.get("to")
        if ev.source == "running" and target != "running":
            self.running -= 1
        elif target == "running" and ev.source != "running":
            self.running += 1
        if trigger in ("preempted", "failed"):
            self.cut_short = True

    def on_plan(self, ev: Event) -> None:
        step: Step = ev.data
        total = 0
        for entry in step.entries:
            total += entry.n
            req = self.picture.requests.get(entry.rid)
            if req is not None:
                self._entry(step.step_id, req, entry)
        budget = self.settings.max_batched_tokens
        if budget is None or not step.complete:
            return
        if total > budget:
            self.fail(11, f"step {step.step_id} schedules {total} tokens, the budget is {budget}")
        elif not self.cut_short:
            self._work_conserved(step, total, budget)

    def _entry(self, step_id: int, req: Req, entry: Entry) -> None:
        end = entry.before + entry.n
        if entry.n <= 0:
            self.fail(11, f"step {step_id} schedules {entry.n} tokens of {req.rid}")
        if req.max_tokens is not None and end > req.prompt + req.max_tokens - 1:
            self.fail(11, f"step {step_id} computes {req.rid} up to token {end}, past its last input "
                          f"{req.prompt + req.max_tokens - 1} (prompt {req.prompt} + max_tokens {req.max_tokens} - 1)")
        if entry.samples is None or entry.epoch != req.epoch:
            return
        if end > req.known:
            self.fail(11, f"step {step_id} computes {req.rid} up to token {end}, past the {req.known} tokens it has "
                          f"(prompt {req.prompt}, {req.generated} delivered, {req.in_flight} sampled by steps in "
                          f"flight)")
        hashes = entry.hashes or ()
        if len(hashes) < end // self.bt:
            self.fail(11, f"step {step_id} fills {end // self.bt} full blocks of {req.rid} but names only "
                          f"{len(hashes)} block hashes")
        elif len(hashes) > cdiv(req.known + 1, self.bt) + 1 and len(hashes) > req.arrival_blocks:
            self.fail(11, f"step {step_id} names {len(hashes)} block hashes for {req.rid}, which has "
                          f"{req.known} tokens")

    def _work_conserved(self, step: Step, total: int, budget: int) -> None:
        planned = {e.rid for e in step.entries}
        idle = None
        for req in self.picture.requests.values():
            if req.state != "running" or req.rid in planned or req.known <= req.computed:
                continue
            if req.max_tokens is not None and req.generated + req.in_flight >= req.max_tokens:
                continue  # its last token is sampled already
            if cdiv(req.computed + min(req.known - req.computed, budget), self.bt) > cdiv(req.computed, self.bt):
                return  # a chunk of it may need a new block: it may have stopped the pass
            idle = idle or req
        if idle is not None and total < budget:
            self.fail(11, f"step {step.step_id} schedules {total} of {budget} budget tokens but leaves out running "
                          f"{idle.rid}, which has {idle.known - idle.computed} tokens to compute ({idle.computed} "
                          f"computed) and needs no new block (work conservation)")

    def on_end(self, ev: Event) -> None:
        cap = self.settings.max_running
        if cap is not None and self.running > cap and self.picture.cut is None:
            self.fail(11, f"{self.running} requests running, max_running is {cap}")
