"""Invariant 10, provenance: every hit, load, join and store reads only blocks whose
content is what it takes them for.

Content is symbolic. Each device block and each tier copy holds a ``Content``: the block
hash whose tokens it holds, how many of them were written, how many a step output (or a
confirmed source) vouches for, or why nothing in it may be read (a load in flight, a
failed load, a failed store).

- Device (live: step plans name every entry with its block table). A step writes its
  chunk into its blocks; its output confirms those writes. A step reads the blocks of its
  tokens before its chunk: each must hold this request's block with those tokens written.
  vLLM caches a block when the step that computes it is scheduled: steps run in order on
  the device, so a hit on a block a step computes is sound from the step that computes it
  on, confirmed or not. A load's or a join's blocks hold nothing usable until it lands; a
  join copies its owner's block once the owner landed (an owner not landed, or failed,
  leaves garbage). A store reads a full block its request's step outputs confirmed.
- Tiers (from a trace too): a store's copy is the block it read, once every rank
  reported it; a failed store leaves no copy; a prefetch lands its source's copy (not if
  it failed or was abandoned); a load or prefetch reads only a complete, confirmed copy
  (``Settings.tier_content_known``: one it saw written, or seeded).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvlife.specs.observers.base import Context, Event, Observer, cdiv
from kvlife.specs.observers.picture import Entry, Job, Move, Req, Step

_Writer = tuple[int, int, int]  # (device block, the block hash it fills, tokens of it written once the step ran)


@attrs.define(slots=True, eq=False)
class Content:
    key: int | None  # the block hash whose tokens it holds (None: nothing usable)
    filled: int = 0  # tokens of that block written
    confirmed: int = 0  # of those, tokens a step output (or a confirmed source) vouches for
    bad: str | None = None  # why nothing in it may be read
    # The content of the block before it in the table of the step that wrote it: computed
    # over that, it is garbage once that turns out to be (a failed step's block).
    over: Content | None = None

    def describe(self, need: int, key: int | None = None) -> str:
        """What it holds, for a finding (``need``: tokens read, ``key``: the block expected)."""
        if self is UNKNOWN:
            return "was never written"
        if self.bad is not None:
            return f"holds no usable content ({self.bad})"
        if key is not None and self.key != key:
            return f"holds block {self.key}"
        if self.filled < need:
            return f"holds only {self.filled} of the {need} tokens read"
        return f"holds {self.filled} tokens of which only {self.confirmed} were confirmed by a step output"


UNKNOWN = Content(None, bad="never written")


def _good(content: Content, key: int, need: int) -> bool:
    return content.bad is None and content.key == key and content.filled >= need


class Provenance(Observer):
    invariants = (10,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.device: dict[int, Content] = {}
        self.tier: dict[tuple[str, int], Content] = {}
        self.sources: dict[int, dict[int, Content]] = {}  # job -> what each of its moves read (by hash)
        self.writes: dict[int, list[_Writer]] = {}  # step -> its writes, until its output
        # rid -> (epoch, the leading device blocks that passed, and the contents they held).
        self.passed: dict[str, tuple[int, list[int], list[Content]]] = {}

    def seed_tier(self, tier: str, hashes: Iterable[int]) -> None:
        """Copies a tier held before the run started (a warm tier): complete and confirmed."""
        for h in hashes:
            self.tier[(tier, h)] = Content(h, self.bt, self.bt)

    # ---- steps ------------------------------------------------------------------------------
    def on_plan(self, ev: Event) -> None:
        step = ev.data
        if not step.complete:
            return
        writes: list[_Writer] = []
        for entry in step.entries:  # every write of the step first: a hit in it is sound
            req = self.picture.requests.get(entry.rid)
            if req is not None and entry.table is not None:
                self._write(step.step_id, req, entry, writes)
        for entry in step.entries:
            req = self.picture.requests.get(entry.rid)
            if req is not None and entry.table is not None:
                self._read(step.step_id, req, entry)
        if writes:
            self.writes[step.step_id] = writes

    def _write(self, step_id: int, req: Req, entry: Entry, writes: list[_Writer]) -> None:
        bt, table, end = self.bt, entry.table or (), entry.before + entry.n
        if cdiv(end, bt) > len(table):
            self.fail(10, f"step {step_id}: {req.rid} computes tokens up to {end} with a block table of "
                          f"{len(table)} blocks")
            return
        for i in range(entry.before // bt, cdiv(end, bt)):
            block, key, upto = table[i], req.hash_at(i), min(bt, end - i * bt)
            current = self.device.get(block)
            if current is not None and current.key == key and current.bad is None:
                current.filled = max(current.filled, upto)  # the same tokens again, or the next ones
            else:
                self.device[block] = Content(key, upto, over=self.device.get(table[i - 1]) if i else None)
            writes.append((block, key, upto))

    def _read(self, step_id: int, req: Req, entry: Entry) -> None:
        """The blocks of its tokens before the chunk hold its blocks, with those tokens."""
        bt, table, before = self.bt, entry.table or (), entry.before
        epoch, blocks, contents = self.passed.get(req.rid, (-1, [], []))
        start = len(blocks)
        if epoch != req.epoch or start > len(table) or list(table[:start]) != blocks \
                or any(self.device.get(b) is not c for b, c in zip(blocks, contents, strict=True)):
            start, blocks, contents = 0, [], []
        for i in range(start, cdiv(before, bt)):
            need = min(bt, before - i * bt)
            if i >= len(table):
                self.fail(10, f"step {step_id}: {req.rid} reads {before} cached tokens with a block table of "
                              f"{len(table)} blocks")
                return
            content, key = self.device.get(table[i], UNKNOWN), req.hash_at(i)
            if not _good(content, key, need):
                self.fail(10, f"step {step_id}: {req.rid} reads device block {table[i]} as its block {i} (tokens "
                              f"{i * bt}..{i * bt + need - 1}), but it {content.describe(need, key)}")
                return
            if need == bt and len(blocks) == i:
                blocks.append(table[i])
                contents.append(content)
        self.passed[req.rid] = (req.epoch, blocks, contents)

    def on_output(self, ev: Event) -> None:
        step = ev.data
        if step.failed_ranks:
            self._failed_step(step)
            return
        for block, key, upto in self.writes.pop(step.step_id, ()):
            content = self.device.get(block)
            if content is not None and content.key == key and content.bad is None:
                content.confirmed = max(content.confirmed, upto)

    def _failed_step(self, step: Step) -> None:
        """It wrote nothing usable on those ranks: neither what it wrote nor any block
        computed over that (a later step of a request that hit it) may be read again."""
        why = f"step {step.step_id} failed on ranks {list(step.failed_ranks)}"
        for block, _, _ in self.writes.pop(step.step_id, ()):
            content = self.device.get(block)
            if content is not None:
                content.bad = why  # (in place: contents computed over it point to it)
            self.device[block] = Content(None, bad=why)
        changed = True
        while changed:
            changed = False
            for content in self.device.values():
                if content.bad is None and content.over is not None and content.over.bad is not None:
                    content.bad = f"computed over a block {why}"
                    changed = True

    # ---- jobs -------------------------------------------------------------------------------
    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is None or job.moves is None:
            return
        reads = self.sources[job.job_id] = {}
        for move in job.moves:
            if job.kind == "prefetch":
                reads[move.block_hash] = self._read_tier(job, move.tier, move.block_hash)
            elif job.kind == "store":
                reads[move.block_hash] = self._read_device(job, move)
            elif not job.join:
                reads[move.block_hash] = self._read_tier(job, move.tier, move.block_hash)
            if job.kind == "load" and self.settings.live:
                self.device[move.device] = Content(None, bad=f"load job {job.job_id} in flight")  # type: ignore[index]

    def _read_tier(self, job: Job, tier: str, block_hash: int) -> Content:
        content = self.tier.get((tier, block_hash))
        full = Content(block_hash, self.bt, self.bt)
        if content is None:
            if self.settings.tier_content_known:
                self.fail(10, f"{job.kind} job {job.job_id} reads block {block_hash} from {tier}, which holds no copy "
                              f"of it (never stored there, or evicted since)")
            return full
        if not _good(content, block_hash, self.bt) or content.confirmed < self.bt:
            self.fail(10, f"{job.kind} job {job.job_id} reads block {block_hash} from {tier}, whose copy "
                          f"{content.describe(self.bt, block_hash)}")
        return content

    def _read_device(self, job: Job, move: Move) -> Content:
        if not self.settings.live:
            return Content(move.block_hash, self.bt, self.bt)
        content = self.device.get(move.device, UNKNOWN)  # type: ignore[arg-type]
        if not _good(content, move.block_hash, self.bt) or content.confirmed < self.bt:
            self.fail(10, f"store job {job.job_id} of {job.rid} reads device block {move.device} as block "
                          f"{move.block_hash}, but it {content.describe(self.bt, move.block_hash)}")
        return Content(move.block_hash, content.filled, content.confirmed) if content.key == move.block_hash \
            and content.bad is None else Content(None, bad=f"store job {job.job_id} read a bad block")

    def on_job_complete(self, ev: Event) -> None:
        job = ev.job
        assert job is not None
        getattr(self, "_landed_" + job.kind)(job)

    def _landed_load(self, job: Job) -> None:
        if not self.settings.live:
            return
        reads = self.sources.pop(job.job_id, {})
        for move in job.moves or ():
            if move.block_hash in job.failed or job.timed_out:
                why = "failed" if move.block_hash in job.failed else "was given up"
                self.device[move.device] = Content(None, bad=f"load job {job.job_id} {why}")  # type: ignore[index]
            elif job.join:
                self.device[move.device] = self._joined(job, move)  # type: ignore[index]
            else:
                source = reads.get(move.block_hash, Content(move.block_hash, self.bt, self.bt))
                self.device[move.device] = attrs.evolve(source)  # type: ignore[index]

    def _joined(self, job: Job, move: Move) -> Content:
        """What a join copied: its owner's block, once the owner landed it on the rank (the
        workers order a join after its owner; the engine may hear the owner's report after
        the join's: then the join's own report carries the owner's failures)."""
        owner = self.picture.jobs.get(job.after) if job.after is not None else None
        if owner is not None and not owner.complete:
            landing = self.sources.get(owner.job_id, {}).get(move.block_hash)
            return attrs.evolve(landing) if landing is not None else Content(move.block_hash, self.bt, self.bt)
        if owner is not None and (owner.timed_out or move.block_hash in owner.failed):
            return Content(None, bad=f"join job {job.job_id} copied block {move.block_hash}, which its owner, load "
                                     f"job {owner.job_id}, failed to land")
        found = [m.device for m in owner.moves or () if m.block_hash == move.block_hash] if owner else []
        source = found[0] if found else move.slot
        content = self.device.get(source, UNKNOWN) if source is not None else UNKNOWN
        if not _good(content, move.block_hash, self.bt):
            return Content(None, bad=f"join job {job.job_id} copied device block {source}, which "
                                     f"{content.describe(self.bt, move.block_hash)}")
        return attrs.evolve(content)

    def on_start_load(self, ev: Event) -> None:
        """Live: a join's command names the load it follows (its record says which), or the
        workers may copy the owner's blocks before that load landed in them."""
        job, command = ev.job, ev.data
        if job is not None and job.after is not None and getattr(command, "after", None) != job.after:
            self.fail(10, f"join job {job.job_id} copies the device blocks load job {job.after} brings, but its "
                          f"command names {getattr(command, 'after', None)} to follow: the workers may copy them "
                          f"before that load landed")

    def _landed_store(self, job: Job) -> None:
        reads = self.sources.pop(job.job_id, {})
        for move in job.moves or ():
            if move.block_hash in job.failed or job.timed_out:
                self.tier[(move.tier, move.block_hash)] = Content(
                    None, bad=f"store job {job.job_id} {'timed out' if job.timed_out else 'failed'}")
            else:
                source = reads.get(move.block_hash, Content(move.block_hash, self.bt, self.bt))
                self.tier[(move.tier, move.block_hash)] = attrs.evolve(source)

    def _landed_prefetch(self, job: Job) -> None:
        reads = self.sources.pop(job.job_id, {})
        for move in job.moves or ():
            key = (str(move.dst), move.block_hash)
            if job.abandoned:
                self.tier[key] = Content(None, bad=f"prefetch job {job.job_id} was abandoned at its patience")
            elif move.block_hash in job.failed:
                self.tier[key] = Content(None, bad=f"prefetch job {job.job_id} failed to land it")
            else:
                self.tier[key] = attrs.evolve(reads.get(move.block_hash, Content(move.block_hash, self.bt, self.bt)))

    def on_reclaim(self, ev: Event) -> None:
        job = ev.job
        if job is None or not job.open:
            return
        self.sources.pop(job.job_id, None)
        for move in job.moves or ():
            if job.kind == "prefetch":
                self.tier[(str(move.dst), move.block_hash)] = Content(None, bad=f"prefetch job {job.job_id} was "
                                                                                f"reclaimed")
            elif job.kind == "load" and self.settings.live:
                self.device[move.device] = Content(None, bad=f"load job {job.job_id} was reclaimed")  # type: ignore
            elif job.kind == "store":
                self.tier[(move.tier, move.block_hash)] = Content(None, bad=f"store job {job.job_id} was reclaimed")

    def on_evict(self, ev: Event) -> None:
        tier, blocks = ev.get("tier"), ev.get("blocks")
        if isinstance(tier, str) and isinstance(blocks, list):
            for h in blocks:
                self.tier.pop((tier, h), None)

    def holds(self, tier: str, block_hash: int) -> bool:
        """The observer takes ``tier`` to hold a good copy of ``block_hash`` (13 compares)."""
        content = self.tier.get((tier, block_hash))
        return content is not None and content.bad is None and content.key == block_hash
