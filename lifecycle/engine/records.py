"""Trace records: every kind, and the one function that builds each.

A record is a flat dict, ``kind`` first, that the trace writer renders as one JSON line.
The engine, the connector core and the vLLM drivers build them here and nowhere else, so a
kind's fields are written down once (``kvlife validate``, ``replay``, ``explain`` and
``export`` read them back). Input records (``kind: input``) are built by
``events.input_to_record`` from the input events themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any

Record = dict[str, Any]


class Kind(StrEnum):
    HEADER = "header"
    INPUT = "input"
    TRANSITION = "transition"
    DECISION = "decision"
    WARNING = "warning"
    STALE_LOOKUP = "stale_lookup"
    LOOKUP_REUSE = "lookup_reuse"
    JOB = "job"
    JOB_DONE = "job_done"
    FREE = "free"
    EVICT = "evict"
    STORE_REJECTED = "store_rejected"
    STEP = "step"
    RECLAIM = "reclaim"
    ABANDON = "abandon"
    INTERRUPTED = "interrupted"


def transition(t: float, rid: str, source: str, target: str, trigger: str, reason: str) -> Record:
    return {"kind": Kind.TRANSITION, "t": t, "req": rid, "from": source, "to": target, "trigger": trigger,
            "reason": reason}


def decision(t: float, rid: str, point: str, policy: str, value: Any, reason: str) -> Record:
    return {"kind": Kind.DECISION, "t": t, "req": rid, "point": point, "policy": policy, "value": value,
            "reason": reason}


def warning(t: float, what: str, **fields: Any) -> Record:
    return {"kind": Kind.WARNING, "t": t, "what": what, **fields}


def stale_lookup(t: float, rid: str, epoch: int, current_epoch: int | None, state: str | None) -> Record:
    return {"kind": Kind.STALE_LOOKUP, "t": t, "req": rid, "epoch": epoch, "current_epoch": current_epoch,
            "state": state}


def lookup_reuse(t: float, rid: str, answered: float, uses: int, blocks: int, evicted: int) -> Record:
    return {"kind": Kind.LOOKUP_REUSE, "t": t, "req": rid, "answered": answered, "age_ms": t - answered,
            "uses": uses, "blocks": blocks, "evicted": evicted}


def job(t: float, job_id: int, op: str, rid: str, tiers: dict[str, int], moves: list[list[Any]],
        **extra: Any) -> Record:
    return {"kind": Kind.JOB, "t": t, "job": job_id, "op": op, "req": rid, "blocks": len(moves), "tiers": tiers,
            "moves": moves, **extra}


def job_done(t: float, job_id: int, op: str, failed: int, late: bool, abandoned: bool = False) -> Record:
    record: Record = {"kind": Kind.JOB_DONE, "t": t, "job": job_id, "op": op, "failed": failed, "late": late}
    if abandoned:
        record["abandoned"] = True
    return record


def free(t: float, blocks: Sequence[int]) -> Record:
    return {"kind": Kind.FREE, "t": t, "blocks": list(blocks)}


def evict(t: float, tier: str, blocks: Iterable[int]) -> Record:
    return {"kind": Kind.EVICT, "t": t, "tier": tier, "blocks": list(blocks)}


def store_rejected(t: float, rid: str, tier: str, blocks: int) -> Record:
    """``blocks`` a store offered that the tier refused: it is full of copies still being written."""
    return {"kind": Kind.STORE_REJECTED, "t": t, "req": rid, "tier": tier, "blocks": blocks}


def step(t: float, step_id: int, requests: int, prefill_tokens: int, sync_lookups: int,
         prompt: list[list[Any]], fills: list[list[Any]], flush: Sequence[int] = ()) -> Record:
    record: Record = {"kind": Kind.STEP, "t": t, "step": step_id, "requests": requests,
                      "prefill_tokens": prefill_tokens, "sync_lookups": sync_lookups, "prompt": prompt}
    if fills:
        record["fills"] = fills
    if flush:
        record["flush"] = list(flush)
    return record


def reclaim(t: float, job_id: int, op: str, rid: str, ranks: list[int], blocks: int, reason: str) -> Record:
    return {"kind": Kind.RECLAIM, "t": t, "job": job_id, "op": op, "req": rid, "ranks": ranks, "blocks": blocks,
            "reason": reason}


def abandon(t: float, job_id: int, op: str, rid: str, reason: str) -> Record:
    return {"kind": Kind.ABANDON, "t": t, "job": job_id, "op": op, "req": rid, "reason": reason}


def interrupted(t: float, signal: str, clean: bool, requests: dict[str, int], finished: int, not_arrived: int,
                jobs: int, quarantined_jobs: int, prefetches: int, **open_work: int) -> Record:
    """The last record of a run cut short: the engine's time, the signal, whether the cut
    fell between engine calls (``clean``) and the work still open (``kvlife validate`` does
    not hold that work to invariants 3 and 7)."""
    return {"kind": Kind.INTERRUPTED, "t": t, "signal": signal, "clean": clean, "requests": requests,
            "finished": finished, "not_arrived": not_arrived, "jobs": jobs, "quarantined_jobs": quarantined_jobs,
            "prefetches": prefetches, **open_work}


def header(schema: int, config: dict[str, Any], policies: list[str], seed: int, **extra: Any) -> Record:
    return {"kind": Kind.HEADER, "schema": schema, "config": config, "policies": policies, "seed": seed, **extra}
