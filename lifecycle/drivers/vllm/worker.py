"""The worker side: carry out the scheduler side's load and store jobs, report per rank.

Two workers speak the same protocol (``KVLifeMetadata`` in, ``KVLifeWorkerMetadata`` plus
``finished_recving`` / ``finished_sending`` out):

- ``HostPoolWorker``: real bytes. It copies blocks between vLLM's paged KV tensors and a
  kvlife ``HostPool`` (pinned on CUDA): loads in ``start_load_kv`` (vLLM calls it after
  launching the forward pass when the step has no sync loads; every KVLifeConnector load
  is async, into blocks of a request the step does not compute), stores in
  ``wait_for_save`` after the forward pass, and the stores of preempted requests are
  finished in ``handle_preemptions``, before the forward pass reuses their blocks. On CUDA
  the copies run on a side stream that waits for the compute stream, one event per job,
  polled with ``event.query()``; on CPU they are synchronous and report in the same step.
- ``SimulatedWorker``: no bytes; each job completes after a scripted number of steps, so
  tests drive vLLM's real scheduler on a CPU-only machine. Several simulated workers
  report separately, as tensor-parallel ranks do, and vLLM's ``KVOutputAggregator``
  combines them (``finished_recving`` only when every worker reported the request). It is
  the vLLM-order driver's ``SimulatedRank``, behind vLLM's metadata and output classes.

Both keep their books with ``kvlife.lifecycle.engine.worker_book.WorkerBook`` (which
requests they may report finished), as kvlife's engine does for the ranks its drivers play.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.outputs import KVConnectorOutput

from kvlife.lifecycle.drivers.vllm.metadata import KVLifeJob, KVLifeMetadata, KVLifeWorkerMetadata
from kvlife.lifecycle.drivers.vllm_order import DelayFn, FailFn, RankJob, SimulatedRank
from kvlife.lifecycle.engine.worker_book import WorkerBook
from kvlife.transfer.host_pool import HostPool
from kvlife.transfer.layout import BlockGeometry, ModelShape


def rank_jobs(meta: KVLifeMetadata) -> list[RankJob]:
    """A step's jobs as a worker takes them."""
    jobs = {**meta.load_jobs, **meta.store_jobs, **meta.prefetch_jobs}
    return [RankJob(job_id, job.kind, job.req_id, tuple(job.block_hashes),
                    tuple(job.device_blocks) if job.kind != "prefetch" else (), job.after)
            for job_id, job in sorted(jobs.items())]


class SimulatedWorker:
    """One simulated rank inside vLLM (``vllm_order.SimulatedRank``: jobs complete after
    scripted delays, ``fail`` scripts which blocks fail). A load's failed blocks come back
    twice, as vLLM's runner sends them: device blocks in ``invalid_block_ids`` and hashes in
    the rank's report, in the same output as the request's ``finished_recving``. A delay of
    None is a transfer that never ends; a job the scheduler side abandons
    (``KVLifeMetadata.jobs_to_abandon``) is then reported failed, every block."""

    def __init__(self, rank: int = 0, load_delay: int | DelayFn | None = 1,
                 store_delay: int | DelayFn | None = 0, fail: FailFn | None = None) -> None:
        self.rank = rank
        self.sim = SimulatedRank(rank, load_delay, store_delay, fail)

    def run_step(self, meta: Any, out: Any = None) -> KVConnectorOutput:
        """Execute one step's metadata; return this rank's connector output for the step
        (``out``, the scheduler output, is not needed: no bytes move)."""
        if isinstance(meta, KVLifeMetadata):
            reports = self.sim.run_step(rank_jobs(meta), sorted(meta.jobs_to_flush), sorted(meta.jobs_to_abandon),
                                        meta.hold_finished)
        else:
            reports = self.sim.run_step(())
        recving, sending, invalid = self.sim.book.take()
        return KVConnectorOutput(
            finished_recving=recving or None,
            finished_sending=sending or None,
            kv_connector_worker_meta=KVLifeWorkerMetadata(reports) if reports else None,
            invalid_block_ids=invalid,
        )

    @property
    def busy(self) -> bool:
        return self.sim.busy


def _host_geometry(block_bytes: int, block_tokens: int) -> BlockGeometry:
    """A HostPool geometry whose block size is ``block_bytes`` (HostPool only uses bytes)."""
    head_dim, rest = divmod(block_bytes, 2 * block_tokens * 2)
    if rest or head_dim <= 0:
        raise ValueError(f"a {block_bytes}-byte block does not split into {block_tokens} float16 K/V rows")
    return BlockGeometry(ModelShape(num_layers=1, num_kv_heads=1, head_dim=head_dim, dtype="float16",
                                    block_tokens=block_tokens))


# What a copy between vLLM's KV tensors and the host pool raises when it cannot be done
# (a slot out of range, a shape that does not fit, a device error).
_COPY_ERRORS = (RuntimeError, IndexError, ValueError)


class HostPoolWorker:
    """Real copies between vLLM's paged KV tensors and a kvlife HostPool (one rank).

    A copy that raises fails the whole job (every block); ``fail`` scripts failures as the
    simulated worker's does (the failed blocks are not copied). A load's failed device
    blocks are handed to vLLM by ``take_invalid_blocks`` (the connector's
    ``get_block_ids_with_load_errors``), in the same pass as its ``finished_recving``."""

    def __init__(self, rank: int, host_blocks: int, block_tokens: int, num_device_blocks: int,
                 fail: FailFn | None = None) -> None:
        self.rank = rank
        self.host_blocks = host_blocks
        self.block_tokens = block_tokens
        self.num_device_blocks = num_device_blocks
        self.fail = fail
        self.layers: list[tuple[torch.Tensor, int]] = []  # (tensor, block dim)
        self.pool: HostPool | None = None
        self._cuda = False
        self._side: Any = None
        # (job, job spec, event, failed hashes); reported once the event is done.
        self._inflight: list[tuple[int, KVLifeJob, Any, tuple[int, ...]]] = []
        self._reports: list[tuple[int, int, tuple[int, ...]]] = []
        self._book = WorkerBook()
        self.copy_errors = 0
        self._invalid: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        block_bytes = 0
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            dims = [d for d, size in enumerate(tensor.shape) if size == self.num_device_blocks]
            if not dims:
                raise ValueError(f"KV cache {name}: no dimension of {self.num_device_blocks} blocks in "
                                 f"{tuple(tensor.shape)}")
            self.layers.append((tensor, dims[0]))
            block_bytes += tensor.numel() // self.num_device_blocks * tensor.element_size()
        device = self.layers[0][0].device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self._side = torch.cuda.Stream(device=device) if self._cuda else None
        self.pool = HostPool(_host_geometry(block_bytes, self.block_tokens), self.host_blocks,
                             pin_memory=self._cuda)

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        idx = torch.as_tensor(blocks, dtype=torch.int64, device=self.layers[0][0].device)
        parts = [t.index_select(dim, idx).movedim(dim, 0).reshape(len(blocks), -1).view(torch.uint8)
                 for t, dim in self.layers]
        return torch.cat(parts, dim=1)

    def _scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        idx = torch.as_tensor(blocks, dtype=torch.int64, device=self.layers[0][0].device)
        offset = 0
        for t, dim in self.layers:
            width = t.numel() // self.num_device_blocks * t.element_size()
            part = rows[:, offset:offset + width].contiguous().view(t.dtype)
            shape = list(t.shape)
            shape.pop(dim)
            t.index_copy_(dim, idx, part.reshape(len(blocks), *shape).movedim(0, dim))
            offset += width

    def _copy(self, job: KVLifeJob, keep: list[int]) -> None:
        """Copy the moves at positions ``keep`` of ``job``."""
        assert self.pool is not None
        if not keep:
            return
        slots = [job.slots[i] for i in keep]
        devices = [job.device_blocks[i] for i in keep]
        if job.after is not None:  # a join: the device blocks the load it follows filled
            self._scatter(devices, self._gather(slots))
        elif job.kind == "load":
            rows = torch.empty((len(slots), self.pool.block_bytes), dtype=torch.uint8)
            self.pool.read_many(slots, rows)
            self._scatter(devices, rows.to(self.layers[0][0].device, non_blocking=True))
        else:
            self.pool.write_many(slots, self._gather(devices).cpu())

    def _run(self, job_id: int, job: KVLifeJob) -> None:
        self._book.add(job_id, job.kind, job.req_id, job.block_hashes, job.device_blocks, job.after)
        failed = tuple(self.fail(self.rank, job.kind, job.req_id, job.block_hashes)) if self.fail is not None else ()
        bad = set(failed)
        keep = [i for i, h in enumerate(job.block_hashes) if h not in bad]
        stream = torch.cuda.stream(self._side) if self._cuda else None
        if stream is not None:
            self._side.wait_stream(torch.cuda.current_stream())
            stream.__enter__()
        event = None
        try:
            try:
                self._copy(job, keep)
            except _COPY_ERRORS:
                self.copy_errors += 1
                failed = tuple(job.block_hashes)  # the job failed as a whole
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._side)
        finally:
            if stream is not None:
                stream.__exit__(None, None, None)
        self._inflight.append((job_id, job, event, failed))

    def flush(self, meta: KVLifeMetadata) -> None:
        """Before the forward pass: end the stores of preempted requests (their blocks are
        reused by this step) and learn which finished requests are held."""
        self._book.hold(meta.hold_finished)
        for job_id in sorted(meta.jobs_to_flush):
            self._poll(wait=True, only=job_id)

    def start_load(self, meta: KVLifeMetadata) -> None:
        self.flush(meta)
        for job_id, job in sorted(meta.load_jobs.items()):
            self._run(job_id, job)
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._side)  # the forward pass reads the loads

    def save(self, meta: KVLifeMetadata) -> None:
        for job_id, job in sorted(meta.store_jobs.items()):
            self._run(job_id, job)
        for job_id, job in sorted(meta.prefetch_jobs.items()):
            # Only a host tier lives here: a pull from a lower tier cannot be made (every
            # block fails; the request computes what it would have brought).
            self.copy_errors += 1
            self._report(job_id, job, tuple(job.block_hashes))
        if meta.jobs_to_abandon:
            self._abandon(meta.jobs_to_abandon)

    def _abandon(self, jobs: set[int]) -> None:
        """Stores the scheduler side gave up on: report the ones still copying as failed.
        Their copies stay queued on the side stream, ahead of every later copy, so a host
        slot handed out again is written after them. (It gives up on no load.)"""
        keep = []
        for job_id, job, event, failed in self._inflight:
            if job_id in jobs and job.kind == "store":
                self._report(job_id, job, tuple(job.block_hashes))
            else:
                keep.append((job_id, job, event, failed))
        self._inflight = keep

    def _report(self, job_id: int, job: KVLifeJob, failed: tuple[int, ...]) -> None:
        self._reports.append((job_id, self.rank, failed))
        self._book.done(job_id, failed)

    def _poll(self, wait: bool = False, only: int | None = None) -> None:
        keep = []
        for job_id, job, event, failed in self._inflight:
            if only is not None and job_id != only:
                keep.append((job_id, job, event, failed))
                continue
            if event is not None and not event.query():
                if not wait:
                    keep.append((job_id, job, event, failed))
                    continue
                event.synchronize()
            self._report(job_id, job, failed)
        self._inflight = keep

    def take_output(self) -> tuple[set[str], set[str], KVLifeWorkerMetadata | None]:
        """(finished_sending, finished_recving, worker metadata) since the last call."""
        self._poll()
        reports, self._reports = self._reports, []
        recving, sending, invalid = self._book.take()
        self._invalid |= invalid
        return sending, recving, KVLifeWorkerMetadata(reports) if reports else None

    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._reports)

    def take_invalid_blocks(self) -> set[int]:
        """Device blocks of failed loads reported since the last call (vLLM's invalid_block_ids)."""
        out, self._invalid = self._invalid, set()
        return out


class OffloadingSimulatedWorker:
    """A simulated worker for vLLM's own OffloadingConnector (whose real worker needs CUDA):
    its jobs complete after scripted delays and come back as ``OffloadingWorkerMetadata``
    counts plus ``finished_recving`` for requests whose loads all landed."""

    def __init__(self, rank: int = 0, load_delay: int = 1, store_delay: int = 0) -> None:
        self.rank = rank
        self.load_delay = load_delay
        self.store_delay = store_delay
        self.step = 0
        self._due: dict[int, tuple[int, str, str]] = {}  # job -> (due step, kind, request)
        self._loads_of: dict[str, set[int]] = {}

    def run_step(self, meta: Any, out: Any = None) -> KVConnectorOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        self.step += 1
        for job_id, job in sorted((getattr(meta, "load_jobs", None) or {}).items()):
            self._due[job_id] = (self.step + self.load_delay, "load", job.req_id)
            self._loads_of.setdefault(job.req_id, set()).add(job_id)
        for job_id, job in sorted((getattr(meta, "store_jobs", None) or {}).items()):
            self._due[job_id] = (self.step + self.store_delay, "store", job.req_id)
        for job_id in getattr(meta, "jobs_to_flush", None) or ():
            if job_id in self._due:
                _, kind, rid = self._due[job_id]
                self._due[job_id] = (self.step, kind, rid)
        done = sorted(j for j, (due, _, _) in self._due.items() if due <= self.step)
        recving: set[str] = set()
        for job_id in done:
            _, kind, rid = self._due.pop(job_id)
            if kind == "load":
                jobs = self._loads_of[rid]
                jobs.discard(job_id)
                if not jobs:
                    del self._loads_of[rid]
                    recving.add(rid)
        meta_out = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)) if done else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta_out)

    @property
    def busy(self) -> bool:
        return bool(self._due)
