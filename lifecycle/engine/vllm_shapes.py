"""vLLM 0.33's data shapes, as kvlife's scheduler hands them to the connector.

``connector_api.ConnectorAPI`` reads a scheduler's output, a request and a step's connector
output by the attribute names vLLM gives them (``SchedulerOutput``, ``Request``,
``KVConnectorOutput``), so the same code reads vLLM's objects inside vLLM and these inside
kvlife. Only the fields a KV connector reads are here.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvlife.lifecycle.engine.events import BlockHash


@attrs.frozen(slots=True)
class NewRequestData:
    """A request scheduled for the first time since it was (re)admitted: its whole table."""

    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]  # one list per KV cache group (kvlife: one)


@attrs.frozen(slots=True)
class CachedRequestData:
    """The requests scheduled again: their new blocks (None: none)."""

    req_ids: list[str]
    num_computed_tokens: list[int]
    new_block_ids: list[tuple[list[int], ...] | None]
    resumed_req_ids: set[str]


@attrs.frozen(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # in scheduling order
    preempted_req_ids: set[str]
    finished_req_ids: set[str]


@attrs.frozen(slots=True)
class WorkerMeta:
    """The workers' per-rank job reports (``KVLifeWorkerMetadata.reports``)."""

    reports: Sequence[tuple[int, int, tuple[BlockHash, ...]]] = ()


@attrs.frozen(slots=True)
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_worker_meta: WorkerMeta | None = None
    invalid_block_ids: set[int] = attrs.Factory(set)
