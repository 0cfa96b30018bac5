"""What goes into the engine (input events) and what comes out (commands).

Every input carries the time the driver says it is (``t``, milliseconds): the core never
reads a clock. Inputs serialise to flat dicts for the trace and come back from them for
replay, so they are the whole truth about a run.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, cast

import attrs

BlockHash = int


# ---- inputs -------------------------------------------------------------------------
@attrs.frozen(slots=True)
class Arrival:
    type: ClassVar[str] = "arrival"
    t: float
    request_id: str
    prompt_tokens: int
    block_hashes: tuple[BlockHash, ...]
    resumable: bool = False  # streaming/resumable input: early prefetch must skip it
    # The request's output limit (vLLM's ``max_tokens``), when known. Under async
    # scheduling the scheduler then never schedules a step past it (vLLM does the same);
    # a stop before it (EOS) still comes only with a step output.
    max_tokens: int | None = None


@attrs.frozen(slots=True)
class Abort:
    type: ClassVar[str] = "abort"
    t: float
    request_id: str


@attrs.frozen(slots=True)
class Tick:
    type: ClassVar[str] = "tick"
    t: float


@attrs.frozen(slots=True)
class LookupAnswer:
    """Answer of an async lookup: the tier of each leading hit block (None: the lookup
    failed, which counts as a miss)."""

    type: ClassVar[str] = "lookup_answer"
    t: float
    request_id: str
    epoch: int
    tiers: tuple[str, ...] | None


@attrs.frozen(slots=True)
class TransferReport:
    """One rank's terminal report for one job; ``failed`` lists the bad block hashes."""

    type: ClassVar[str] = "transfer_report"
    t: float
    job_id: int
    rank: int
    failed: tuple[BlockHash, ...] = ()


@attrs.frozen(slots=True)
class StepOutput:
    """The model ran step ``step_id`` (the oldest step in flight): every entry that
    completed its known tokens sampled one token; ``finished`` names requests whose token
    was their last, with the reason; ``reports`` are the workers' transfer reports that came
    with this output (vLLM's ``kv_connector_output``), applied after the tokens, as vLLM
    applies them. ``failed_ranks``: the ranks where the step raised and wrote no KV (the
    live runtime; vLLM's engine would die): its requests are aborted and the blocks it was
    to write leave the prefix cache before anything else of the output applies."""

    type: ClassVar[str] = "step_output"
    t: float
    step_id: int
    finished: tuple[tuple[str, str], ...] = ()
    reports: tuple[tuple[int, int, tuple[BlockHash, ...]], ...] = ()
    failed_ranks: tuple[int, ...] = ()


InputEvent = Arrival | Abort | Tick | LookupAnswer | TransferReport | StepOutput

_INPUT_TYPES: dict[str, type[Any]] = {
    cls.type: cls for cls in (Arrival, Abort, Tick, LookupAnswer, TransferReport, StepOutput)
}
_TUPLE_FIELDS = {"block_hashes", "tiers", "failed"}


def input_to_record(event: InputEvent) -> dict[str, Any]:
    # The two inputs of every step first, written out: the same dict ``attrs.asdict`` makes.
    kind = type(event)
    if kind is Tick:
        return {"kind": "input", "type": "tick", "t": event.t}
    if kind is StepOutput:
        step = cast(StepOutput, event)
        record = {"kind": "input", "type": "step_output", "t": step.t, "step_id": step.step_id,
                  "finished": [list(pair) for pair in step.finished]}
        if step.reports:
            record["reports"] = [[job, rank, list(failed)] for job, rank, failed in step.reports]
        if step.failed_ranks:
            record["failed_ranks"] = list(step.failed_ranks)
        return record
    record = {"kind": "input", "type": event.type}
    record.update(attrs.asdict(event, recurse=False))
    if isinstance(event, Arrival) and event.max_tokens is None:
        del record["max_tokens"]  # traces written before the field stay byte-identical
    return record


class BadEvent(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field {field!r}: {message}")
        self.field = field


def input_from_record(record: dict[str, Any]) -> InputEvent:
    """Rebuild an input event from its trace record; raises ``BadEvent`` naming the field."""
    kind = record.get("type")
    cls = _INPUT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadEvent("type", f"unknown input event type {kind!r}")
    values: dict[str, Any] = {}
    for field in attrs.fields(cls):
        if field.name not in record:
            if field.default is attrs.NOTHING:
                raise BadEvent(field.name, f"missing in {kind} event")
            continue
        value = record[field.name]
        if field.name == "reports" and cls is StepOutput:
            value = _reports(value)
        elif field.name == "failed_ranks" and cls is StepOutput:
            if not isinstance(value, list) or not value or not all(_is_int(r) and r >= 0 for r in value):
                raise BadEvent("failed_ranks", "expected a non-empty list of rank numbers")
            value = tuple(value)
        elif field.name == "finished" and cls is StepOutput:
            if not isinstance(value, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in value
            ):
                raise BadEvent("finished", "expected a list of [request_id, reason] pairs")
            value = tuple((p[0], p[1]) for p in value)
        elif field.name in _TUPLE_FIELDS and value is not None:
            if not isinstance(value, list):
                raise BadEvent(field.name, f"expected a list, got {type(value).__name__}")
            value = tuple(value)
        values[field.name] = value
    _check_types(values)
    return cls(**values)  # type: ignore[no-any-return]


def _reports(value: Any) -> tuple[tuple[int, int, tuple[BlockHash, ...]], ...]:
    """A step output's ``reports``: [[job, rank, [failed hashes]], ...]."""
    if not isinstance(value, list):
        raise BadEvent("reports", f"expected a list, got {type(value).__name__}")
    out = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 3 or not all(_is_int(x) for x in item[:2])
                or not isinstance(item[2], list) or not all(_is_int(h) for h in item[2])):
            raise BadEvent("reports", "expected a list of [job, rank, [failed block hashes]]")
        out.append((item[0], item[1], tuple(item[2])))
    return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if name == "t" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadEvent("t", f"expected a number, got {value!r}")
        if name in ("job_id", "rank", "epoch", "step_id", "prompt_tokens") and (
            isinstance(value, bool) or not isinstance(value, int)
        ):
            raise BadEvent(name, f"expected an integer, got {value!r}")
        if name == "max_tokens" and value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise BadEvent(name, f"expected a positive integer or null, got {value!r}")
        if name == "resumable" and not isinstance(value, bool):
            raise BadEvent(name, f"expected true or false, got {value!r}")
        if name == "request_id" and not isinstance(value, str):
            raise BadEvent(name, f"expected a string, got {value!r}")


# ---- commands -----------------------------------------------------------------------
@attrs.frozen(slots=True)
class BlockMove:
    """One block between the device and a tier: ``slot`` is the tier-side position."""

    block_hash: BlockHash
    device_block: int
    tier: str
    slot: int


@attrs.frozen(slots=True)
class SubmitLookup:
    request_id: str
    epoch: int
    block_hashes: tuple[BlockHash, ...]


@attrs.frozen(slots=True)
class DiscardLookup:
    request_id: str
    epoch: int


@attrs.frozen(slots=True)
class StartLoad:
    job_id: int
    request_id: str
    moves: tuple[BlockMove, ...]
    # A join: copy (device to device, each move's ``slot`` the source block) what job
    # ``after`` loads, once it has landed; None: read the tier.
    after: int | None = None


@attrs.frozen(slots=True)
class StartStore:
    job_id: int
    request_id: str
    moves: tuple[BlockMove, ...]


@attrs.frozen(slots=True)
class TierMove:
    """One block pulled from a lower tier into another tier (no device block involved)."""

    block_hash: BlockHash
    src_tier: str
    src_slot: int
    dst_tier: str
    dst_slot: int


@attrs.frozen(slots=True)
class StartPrefetch:
    """Pull blocks from disk/remote into the host tier (early prefetch). Completion comes
    back as one ``TransferReport`` per rank for ``job_id``, like loads and stores."""

    job_id: int
    request_id: str
    moves: tuple[TierMove, ...]


@attrs.frozen(slots=True)
class FreeBlocks:
    device_blocks: tuple[int, ...]


class Scheduled(NamedTuple):
    """One request's share of a step. A named tuple, not an attrs class: the scheduler
    builds one per running request per step (millions per run), and this is the cheapest
    immutable record Python builds."""

    request_id: str
    num_tokens: int
    computed_before: int  # tokens already computed (or in flight) before this step
    samples: bool  # the step reaches the end of the known tokens: a token is sampled
    block_table: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]  # hashes of its blocks so far: prompt, then generated (KV content)


@attrs.frozen(slots=True)
class StepPlan:
    """One scheduler pass's step (it may schedule nothing: its output comes all the same)."""

    step_id: int
    entries: tuple[Scheduled, ...]
    sync_lookups: int  # lookups paid on the scheduler's critical path this pass
    # Blocks each of those lookups asked about, in the order made (a lookup service that
    # charges per key, as the simulator's does, needs them).
    sync_lookup_keys: tuple[int, ...] = ()
    # Store jobs of requests preempted in this pass: the workers finish them before the
    # step writes anything (vLLM frees a preempted request's blocks at once).
    flush: tuple[int, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.num_tokens > 1)


Command = SubmitLookup | DiscardLookup | StartLoad | StartStore | StartPrefetch | FreeBlocks | StepPlan
