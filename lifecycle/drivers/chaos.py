"""The adversarial driver (``kvlife run --chaos SEED``): what reaches the engine, perturbed
within the protocol's rules.

The simulator asks a ``Chaos`` when each completion would reach the engine, and delivers it
then (possibly more than once). What it may do is what a real vLLM engine with a KV
connector may legally do to the scheduler:

- **rank reports** (``TransferReport``: one rank's ``finished_sending`` / ``finished_recving``
  for one job): *delayed* (a slow worker), *duplicated* (per-rank handles that report a
  finished transfer again, vllm#54518; the copy carries the same failed blocks), *reordered*
  (reports of different jobs and ranks overtake each other: falls out of the delays) and
  *dropped*: the report does not come until the engine's transfer deadline has passed, so
  the engine must have given the job up through its deadline, and the report then arrives
  late (as a restarted worker's finished set would), releasing the quarantined blocks. A
  report lost for good would leave those blocks held forever, which invariant 7 rightly
  flags: that is a liveness hole of the protocol, not of the engine, and is not generated.
  Dropping needs ``engine.transfer_deadline_ms`` (``ChaosError`` otherwise);
- **lookup answers** (``LookupAnswer``): *delayed*, *duplicated* (the copy carries the same
  answer; half the copies come up to ``max_duplicate_ms`` later, the other half are kept
  back until the request submits its next lookup, of a newer epoch, and arrive while that
  one is pending: an old-epoch answer) and so *reordered*; and *dropped*: the lookup service
  lost it, and only the engine's lookup deadline (``engine.lookup_deadline_ms``, always set)
  moves the request on, ``lookup_pending -> waiting`` as a miss (``lookup_expired``);
- **step outputs** (``StepOutput``): *delayed* (a slow step; only while a single step can be
  in flight, so outputs never overtake each other: vLLM returns them in order) and
  *duplicated*: a stale copy of an output already delivered arrives later.

Every decision comes from one ``random.Random(seed)`` of its own, drawn in the simulator's
event order, so a chaos run is reproducible (same seed and inputs: byte-identical trace)
and its physics (step costs, jitter, failures: the simulator's own generator) is the plain
run's. ``counts`` says how many of each perturbation the run made.
"""

from __future__ import annotations

import random
from typing import Any, cast

import attrs

from kvlife.lifecycle.engine.events import LookupAnswer, StepOutput, TransferReport

PERTURBATIONS = (
    "reports_delayed", "reports_duplicated", "reports_dropped", "reports_reordered",
    "answers_delayed", "answers_duplicated", "answers_reordered", "answers_old_epoch", "answers_dropped",
    "step_outputs_delayed", "step_outputs_duplicated",
)


class ChaosError(ValueError):
    """A chaos run the config cannot support (one line: what to set)."""


@attrs.frozen
class ChaosRates:
    """How often each perturbation happens, and by how much (ms of simulated time)."""

    report_delay: float = 0.3
    report_duplicate: float = 0.1
    report_drop: float = 0.05
    answer_delay: float = 0.3
    answer_duplicate: float = 0.15
    answer_drop: float = 0.03  # recovered by the engine's lookup deadline (always set)
    step_delay: float = 0.1
    step_duplicate: float = 0.1
    max_delay_ms: float = 20.0  # a delayed report, answer or step output: up to this much later
    max_duplicate_ms: float = 200.0  # a duplicate: up to this much after the original


def check_config(transfer_deadline_ms: float | None, rates: ChaosRates = ChaosRates()) -> None:
    """Refuse a chaos run that drops rank reports without a transfer deadline to recover them."""
    if rates.report_drop and transfer_deadline_ms is None:
        raise ChaosError("a chaos run drops rank reports, which only a transfer deadline recovers: "
                         "set engine.transfer_deadline_ms (--transfer-deadline MS)")


class Chaos:
    """Decides when each completion reaches the engine. ``route_*`` return the deliveries
    as (time, event) pairs, earliest first; the first may be ``now`` (on time)."""

    def __init__(self, seed: int, transfer_deadline_ms: float | None, rates: ChaosRates = ChaosRates()) -> None:
        check_config(transfer_deadline_ms, rates)
        self.seed = seed
        self.rng = random.Random(seed)
        self.rates = rates
        self.deadline = transfer_deadline_ms
        self.counts: dict[str, int] = dict.fromkeys(PERTURBATIONS, 0)
        # Reordering: each completion's index in completion order, and the highest index
        # delivered so far, per kind.
        self._made = {"report": 0, "answer": 0}
        self._delivered = {"report": -1, "answer": -1}
        self._delayed_steps: set[int] = set()
        # Copies of answers kept back, by request, for its next lookup (``replay``).
        self._replays: dict[str, Delivery] = {}

    def _delay(self) -> float:
        return self.rng.uniform(0.0, self.rates.max_delay_ms)

    def _later(self) -> float:
        return self.rng.uniform(0.0, self.rates.max_duplicate_ms)

    def route_report(self, now: float, report: TransferReport) -> tuple[list[tuple[float, Any]], float | None]:
        """A rank report completed at ``now``: its deliveries, and the time the engine must
        tick to see the transfer deadline pass (a dropped report), or None."""
        rng, rates = self.rng, self.rates
        tagged = Delivery(report, self._made["report"])
        self._made["report"] += 1
        wake = None
        roll = rng.random()
        if roll < rates.report_drop:
            assert self.deadline is not None  # check_config
            self.counts["reports_dropped"] += 1
            wake = now + self.deadline
            first = wake + rng.uniform(0.001, self.deadline)
        elif roll < rates.report_drop + rates.report_delay:
            self.counts["reports_delayed"] += 1
            first = now + self._delay()
        else:
            first = now
        deliveries: list[tuple[float, Any]] = [(first, tagged)]
        if rng.random() < rates.report_duplicate:
            self.counts["reports_duplicated"] += 1
            deliveries.append((first + self._later(), Delivery(report, -1)))
        return deliveries, wake

    def route_answer(self, now: float, answer: LookupAnswer) -> list[tuple[float, Any]]:
        """A lookup answered at ``now`` (its tiers read then): its deliveries."""
        rng, rates = self.rng, self.rates
        if rng.random() < rates.answer_drop:
            self.counts["answers_dropped"] += 1
            return []  # lost: the lookup deadline moves the request on
        tagged = Delivery(answer, self._made["answer"])
        self._made["answer"] += 1
        first = now
        if rng.random() < rates.answer_delay:
            self.counts["answers_delayed"] += 1
            first = now + self._delay()
        deliveries: list[tuple[float, Any]] = [(first, tagged)]
        if rng.random() < rates.answer_duplicate:
            self.counts["answers_duplicated"] += 1
            if rng.random() < 0.5:
                deliveries.append((first + self._later(), Delivery(answer, -1)))
            else:  # kept back until the request asks again (``replay``)
                self._replays[answer.request_id] = Delivery(answer, -1)
        return deliveries

    def replay(self, request_id: str, epoch: int) -> Delivery | None:
        """The request submits a lookup of ``epoch``: a copy kept back of an answer to one
        of its older lookups, to arrive while the new one is pending (or None)."""
        kept = self._replays.get(request_id)
        if kept is None or cast(LookupAnswer, kept.event).epoch >= epoch:
            return None
        del self._replays[request_id]
        return kept

    def delay_step(self, now: float, step_id: int, alone: bool) -> float | None:
        """A step ends at ``now``: a later time its output comes at instead, or None.
        ``alone``: no other step can be in flight meanwhile (outputs stay in order)."""
        if not alone or step_id in self._delayed_steps or self.rng.random() >= self.rates.step_delay:
            return None
        self._delayed_steps.add(step_id)
        self.counts["step_outputs_delayed"] += 1
        return now + self._delay()

    def duplicate_step(self, now: float, output: StepOutput) -> tuple[float, StepOutput] | None:
        """A step output was delivered at ``now``: a stale copy of it later, or None."""
        self._delayed_steps.discard(output.step_id)
        if self.rng.random() >= self.rates.step_duplicate:
            return None
        self.counts["step_outputs_duplicated"] += 1
        t = now + self._later()
        return t, StepOutput(t, output.step_id, output.finished)

    def delivered(self, tagged: Delivery, old_epoch: bool) -> None:
        """Count a delivery: reordered when a later completion reached the engine first;
        ``old_epoch``: an answer whose request has moved on to a newer lookup."""
        kind = "report" if isinstance(tagged.event, TransferReport) else "answer"
        if tagged.index >= 0:
            if tagged.index < self._delivered[kind]:
                self.counts[f"{kind}s_reordered"] += 1
            else:
                self._delivered[kind] = tagged.index
        if old_epoch:
            self.counts["answers_old_epoch"] += 1

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, **self.counts}


class Delivery:
    """A completion on its way to the engine; ``index``: its place in completion order
    (-1: a duplicate)."""

    __slots__ = ("event", "index")

    def __init__(self, event: TransferReport | LookupAnswer, index: int) -> None:
        self.event = event
        self.index = index


