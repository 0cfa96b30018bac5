"""What the scheduler-side connector sends to its workers each step, and what they send back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class KVLifeJob:
    """One load or store job: device blocks <-> tier slots, block by block. A join
    (``after``) copies device blocks (``slots`` are the source blocks) once job ``after``,
    a load of the same blocks, has landed on this worker."""

    req_id: str
    kind: str  # "load" | "store"
    tier: str
    block_hashes: list[int]
    device_blocks: list[int]
    slots: list[int]
    after: int | None = None


@dataclass
class KVLifeMetadata(KVConnectorMetadata):
    load_jobs: dict[int, KVLifeJob] = field(default_factory=dict)
    store_jobs: dict[int, KVLifeJob] = field(default_factory=dict)
    # Pulls of lower-tier blocks into the host tier (early prefetch): ``tier`` the source,
    # ``slots`` the source slots, ``device_blocks`` the host slots they land in.
    prefetch_jobs: dict[int, KVLifeJob] = field(default_factory=dict)
    # Store jobs whose blocks vLLM freed at a preemption: finish them before this step computes.
    jobs_to_flush: set[int] = field(default_factory=set)
    # Requests whose blocks vLLM holds until they appear in finished_sending.
    hold_finished: list[str] = field(default_factory=list)
    # Jobs the scheduler side gave up on (a deadline): a worker that has not finished one
    # reports it failed, so its request's held blocks are released.
    jobs_to_abandon: set[int] = field(default_factory=set)


@dataclass
class KVLifeWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-rank job reports: (job id, rank, failed block hashes). ``aggregate`` keeps every
    rank's reports apart, so the scheduler side counts ranks itself (invariant 3)."""

    reports: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVLifeWorkerMetadata)
        return KVLifeWorkerMetadata(self.reports + other.reports)
