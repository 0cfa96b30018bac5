"""What a worker reports with each step output, and how vLLM combines the workers' reports.

A worker (one tensor-parallel rank) learns of jobs and held requests from each step's
connector metadata, and reports, with the step's output, the requests whose loads it has
all finished (vLLM's ``finished_recving``), the held requests whose stores it has all
finished (``finished_sending``), and the device blocks of loads that failed
(``invalid_block_ids``). A request's loads are finished only once the joins copying their
blocks (loads ``after`` one of its jobs) ended too: the scheduler promotes it then, and a
load that failed is recomputed into the very blocks a join would still be reading.
``WorkerBook`` is that bookkeeping for one rank; it knows nothing of
how bytes move. kvlife's workers use it (``drivers.vllm.worker``: the simulated and the
host-pool worker inside vLLM), and so does kvlife's engine for the ranks its drivers play
(``core.Engine``). ``OutputAggregator`` is vLLM's ``KVOutputAggregator``: a request is
finished in the combined output once every rank has reported it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvlife.lifecycle.engine.events import BlockHash


@attrs.define(slots=True)
class _JobEntry:
    kind: str  # "load" or "store"
    request_id: str
    moves: tuple[tuple[BlockHash, int], ...]  # (block hash, device block)


class WorkerBook:
    """One rank's view: jobs it was given, requests it may report finished."""

    def __init__(self) -> None:
        self.jobs: dict[int, _JobEntry] = {}
        self.loads_of: dict[str, set[int]] = {}
        self.stores_of: dict[str, set[int]] = {}
        self.holds: set[str] = set()
        self._recving: set[str] = set()
        self._invalid: set[int] = set()
        # Joins in flight by the load they copy from, and that load's request.
        self._readers: dict[int, set[int]] = {}
        self._owner_request: dict[int, str] = {}
        self._join_of: dict[int, int] = {}  # join job -> the load it copies from
        self._read_waiting: set[str] = set()  # loads all done, joins still reading their blocks

    def add(self, job_id: int, kind: str, request_id: str, hashes: Sequence[BlockHash],
            device_blocks: Sequence[int], after: int | None = None) -> None:
        """A job came with a step's metadata (a prefetch, between tiers, is reported for no
        request: ``device_blocks`` empty; ``after``: a join, copying that load's blocks)."""
        self.jobs[job_id] = _JobEntry(kind, request_id, tuple(zip(hashes, device_blocks, strict=False)))
        if after is not None:
            owner = self.jobs.get(after)
            if owner is not None:  # (an owner this rank already finished has nothing left to read)
                self._readers.setdefault(after, set()).add(job_id)
                self._owner_request[after] = owner.request_id
                self._join_of[job_id] = after
        if kind in ("load", "store"):
            book = self.loads_of if kind == "load" else self.stores_of
            book.setdefault(request_id, set()).add(job_id)

    def hold(self, request_ids: Iterable[str]) -> None:
        """Finished requests whose blocks the scheduler holds until this rank's stores end."""
        self.holds.update(request_ids)

    def done(self, job_id: int, failed: Iterable[BlockHash] = ()) -> None:
        """This rank finished ``job_id`` (``failed``: its blocks that failed)."""
        entry = self.jobs.pop(job_id, None)
        if entry is None:
            return
        owner = self._join_of.pop(job_id, None)
        if owner is not None:
            self._read_done(owner, job_id)
        bad = set(failed)
        if entry.kind == "load" and bad:
            self._invalid.update(device for h, device in entry.moves if h in bad)
        if entry.kind not in ("load", "store"):
            return
        book = self.loads_of if entry.kind == "load" else self.stores_of
        jobs = book.get(entry.request_id)
        if jobs is None:
            return
        jobs.discard(job_id)
        if not jobs:
            del book[entry.request_id]
            if entry.kind == "load":
                if entry.request_id in self._owner_request.values():
                    self._read_waiting.add(entry.request_id)  # joins still copy its blocks
                else:
                    self._recving.add(entry.request_id)

    def _read_done(self, owner: int, join: int) -> None:
        readers = self._readers.get(owner)
        if readers is None:
            return
        readers.discard(join)
        if readers:
            return
        del self._readers[owner]
        rid = self._owner_request.pop(owner)
        if rid in self._read_waiting and rid not in self._owner_request.values():
            self._read_waiting.discard(rid)
            self._recving.add(rid)

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """What this rank reports with the step output: finished_recving, finished_sending
        (held requests with no store left on this rank), the failed loads' device blocks."""
        sending = {rid for rid in self.holds if rid not in self.stores_of}
        self.holds -= sending
        recving, self._recving = self._recving, set()
        invalid, self._invalid = self._invalid, set()
        return recving, sending, invalid

    @property
    def busy(self) -> bool:
        return bool(self.jobs)


class OutputAggregator:
    """vLLM's ``KVOutputAggregator`` for the transfer results: a request is in the combined
    ``finished_recving`` (``finished_sending``) once every one of ``world_size`` ranks has
    reported it there; failed blocks are the union over ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recving: dict[str, int] = {}
        self._sending: dict[str, int] = {}

    def aggregate(self, outputs: Sequence[tuple[set[str], set[str], set[int]]]) -> tuple[
            tuple[str, ...], tuple[str, ...], frozenset[int]]:
        recving = self._count(self._recving, (o[0] for o in outputs))
        sending = self._count(self._sending, (o[1] for o in outputs))
        invalid: set[int] = set()
        for output in outputs:
            invalid |= output[2]
        return recving, sending, frozenset(invalid)

    def _count(self, counts: dict[str, int], sets: Iterable[set[str]]) -> tuple[str, ...]:
        done = []
        for finished in sets:
            for rid in sorted(finished):
                seen = counts.get(rid, 0) + 1
                if seen == self.world_size:
                    counts.pop(rid, None)
                    done.append(rid)
                else:
                    counts[rid] = seen
        return tuple(done)
