"""Invariant 5: a store covers only tokens computed in its request's current epoch and
vouched for (``Req.confirmed``): a prefix hit (the device cache or a landed load: where
the first chunk after an admission starts), or a step whose output arrived. Tokens of a
step still in flight are placeholders (vLLM #27644: their KV is still being written).

From a trace, a step lists only its prompt chunks and the chunks that fill a block; the
chunks that complete a block are all there, which is what a store's block needs. When a
request is admitted again (after a preemption) on a device hit past its prompt, its first
chunk may not be listed: until a listed chunk tells its hit, a block whose tokens a step
output of any of its epochs vouched for passes (the live check, with every entry and
block table, judges those precisely: invariant 10).
"""

from __future__ import annotations

from kvlife.specs.observers.base import Event, Observer
from kvlife.specs.observers.picture import Job, Req


class Stores(Observer):
    invariants = (5,)

    def on_job(self, ev: Event) -> None:
        job, req = ev.job, ev.req
        if job is None or job.kind != "store" or job.moves is None or not self.picture.chunks_known:
            return
        for move in job.moves:
            if req is None:
                self.fail(5, f"store job {job.job_id} writes block {move.block_hash} of {job.rid}, which never "
                             f"arrived")
                return
            position = req.position(move.block_hash, self.bt)
            if position is None:
                self.fail(5, f"store job {job.job_id} writes block {move.block_hash}, not a block {job.rid} has "
                             f"computed")
                return
            end = (position + 1) * self.bt
            lenient = not self.settings.live and not req.hit_known and position < req.ever_blocks
            valid = max(req.confirmed, req.computed) if self.settings.stores_after_forward else req.confirmed
            if end > valid and not lenient:
                self.fail(5, _unconfirmed(job, req, end, valid))
                return


def _unconfirmed(job: Job, req: Req, end: int, valid: int) -> str:
    """Which of the stored positions no step output vouched for, and which of them are
    placeholders (tokens sampled by steps whose output has not arrived)."""
    message = f"store job {job.job_id} of {job.rid} covers tokens up to {end}, only {valid} are computed"
    first_placeholder = max(valid + 1, req.prompt)
    if first_placeholder < end:
        return (f"{message}: positions {first_placeholder}..{end - 1} are placeholders "
                f"(sampled by steps whose output has not arrived)")
    return f"{message} (the rest are in flight)"
