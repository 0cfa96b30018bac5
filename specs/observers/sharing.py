"""Invariant 6 (when the stack shares loads): no two in-flight loads read the same block
from a tier. A request that finds a block already being loaded joins that load (a join
job copies the owner's device block once it landed: it reads no tier); a load given up at
its deadline no longer brings its blocks (a new load may read them again).
"""

from __future__ import annotations

from kvlife.specs.observers.base import Event, Observer


class Sharing(Observer):
    invariants = (6,)

    def on_job(self, ev: Event) -> None:
        job = ev.job
        if not self.settings.sharing or job is None or job.kind != "load" or job.join:
            return
        for move in job.moves or ():
            for other in self.picture.loading.get(move.block_hash, ()):
                self.fail(6, f"load job {job.job_id} ({job.rid}) brings block {move.block_hash} that load job "
                             f"{other.job_id} ({other.rid}) is already loading")
