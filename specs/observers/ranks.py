"""Invariant 3: a job is done only after every expected rank reported it exactly once,
and it is given up at its transfer deadline, never before.

The picture counts every rank's report itself (``transfer_report`` inputs and the
``reports`` of step outputs); the engine's ``job_done`` must come in a handling that
carried a report of that job, once every rank reported, exactly once, never for a job
reclaimed at its deadline, with the failures' union and whether it was given up. A job
whose last rank reported is completed in that handling. A late report is warned
``duplicate_report`` or ``bad_rank_report`` by whether its rank exists. With a transfer
deadline, a load or store some rank has not reported is given up (``rank_timeout``) at
the first tick at or past ``started + deadline``, never before. A load is taken back
(``load_done``) only once every load of its request's epoch completed.
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer, is_int, missing_ranks
from kvlife.specs.observers.picture import Job


class Ranks(Observer):
    invariants = (3,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.reported_now: set[int] = set()  # jobs a report of this handling named
        self.loads: dict[str, list[Job]] = {}  # rid -> its loads of its current epoch

    def on_transfer_report(self, ev: Event) -> None:
        self.reported_now.add(ev.data.job_id)

    def on_output(self, ev: Event) -> None:
        event = self.picture.input
        self.reported_now.update(job for job, _, _ in getattr(event, "reports", ()))

    def on_job(self, ev: Event) -> None:
        job, req = ev.job, ev.req
        if job is not None and req is not None and job.kind == "load":
            loads = [j for j in self.loads.get(req.rid, ()) if j.epoch == req.epoch]
            self.loads[req.rid] = [*loads, job]

    def on_job_done(self, ev: Event) -> None:
        job, job_id = ev.job, ev.get("job")
        if job is None:
            self.fail(3, f"job_done for job {job_id}, which never started")
        elif job.done_recorded:
            self.fail(3, f"job {job_id} completed twice")
        elif job.reclaimed:
            self.fail(3, f"job {job_id} completed after it was reclaimed at its deadline (a late report must be "
                         f"ignored)")
        elif job.job_id not in self.reported_now:
            self.fail(3, f"job {job_id} completed without a report for it")
        elif not job.complete:
            self.fail(3, f"{job.kind} job {job_id} counted done with ranks "
                         f"{missing_ranks(self.settings.ranks, job.reported)} still to report "
                         f"(reported: {sorted(job.reported)})")
        else:
            self._outcome(ev, job)

    def _outcome(self, ev: Event, job: Job) -> None:
        late, failed = ev.get("late"), ev.get("failed")
        if isinstance(late, bool) and late != job.timed_out:
            self.fail(3, f"{job.kind} job {job.job_id}: job_done says late={late}, but it was "
                         f"{'' if job.timed_out else 'not '}given up at its deadline")
        if is_int(failed) and failed != len(job.failed):
            self.fail(3, f"job {job.job_id}: {failed} failed blocks reported, the union over ranks is "
                         f"{len(job.failed)}")

    def on_reclaim(self, ev: Event) -> None:
        job = ev.job
        if job is None:
            self.fail(0, f"reclaim record for job {ev.get('job')}, which never started")
        elif not job.open:
            self.fail(3, f"{job.kind} job {job.job_id} reclaimed after it had ended")

    def on_warning(self, ev: Event) -> None:
        what, rank = ev.get("what"), ev.get("rank")
        if what in ("bad_rank_report", "duplicate_report") and is_int(rank) \
                and (0 <= rank < self.settings.ranks) != (what == "duplicate_report"):
            self.fail(3, f"a report of job {ev.get('job')} from rank {rank} is warned {what}, with "
                         f"{self.settings.ranks} ranks (0..{self.settings.ranks - 1})")
        elif what == "rank_timeout":
            self._given_up(self.picture.job(ev.get("job")))

    def _given_up(self, job: Job | None) -> None:
        deadline, t = self.settings.transfer_deadline_ms, self.ctx.t
        if job is None or not job.open or job.timed_out or deadline is None or job.t is None or t is None:
            return
        owner = self.picture.jobs.get(job.after) if job.after is not None else None
        if owner is not None and owner.timed_out:
            return  # a join of a load given up: what it copies is no one's, it goes with it
        if job.kind in ("load", "store") and t - job.t < deadline:
            self.fail(3, f"job {job.job_id} given up at t={t:g}, before its deadline (started t={job.t:g}, "
                         f"{deadline:g} ms)")

    def on_transition(self, ev: Event) -> None:
        req = ev.req
        if ev.get("trigger") != "load_done" or req is None:
            return
        waiting = [j for j in self.loads.get(req.rid, ()) if j.epoch == req.epoch and not j.complete]
        if waiting:
            job = waiting[0]
            self.fail(3, f"{req.rid} took back its load (load_done) with {job.kind} job {job.job_id} still owed by "
                         f"ranks {missing_ranks(self.settings.ranks, job.reported)}")

    def on_end(self, ev: Event) -> None:
        self.reported_now = set()
        cut = self.picture.cut
        if cut is None or cut.get("clean") is not False:
            # (A cut inside a handling may come before the engine recorded the completion.)
            for job in self.picture.completed_now:
                if not job.done_recorded:
                    self.fail(3, f"{job.kind} job {job.job_id}: every rank reported, yet it was not completed")
        if self.picture.input_is("tick") and cut is None:
            self._deadlines_acted_on()

    def _deadlines_acted_on(self) -> None:
        deadline, now = self.settings.transfer_deadline_ms, self.ctx.t
        if deadline is None or now is None:
            return
        for job in self.picture.open.values():  # in start order
            if job.timed_out or job.kind == "prefetch" or job.t is None:
                continue
            if now - job.t < deadline:
                return  # the rest started later
            self.fail(3, f"job {job.job_id} started at t={job.t:g} is past its {deadline:g} ms deadline at "
                         f"t={now:g}, yet the tick did not give it up")
            return
