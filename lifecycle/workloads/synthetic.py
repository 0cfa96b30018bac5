"""A seeded synthetic workload with the two things that make prefix caching matter.

* Shared prefixes: a few system prompts, each a fixed run of full blocks, start the
  prompts of many unrelated conversations.
* Multi-turn sessions: turn k+1's prompt is turn k's prompt, turn k's answer and a new
  user message, so its block hashes start with turn k's full blocks, then the blocks
  that turn k's answer filled.

Block hashes follow the Mooncake rule (one per ``block_tokens`` prompt tokens, the last
may be partial, chained: a hash names the whole prefix up to its block). Chaining comes
for free from how ids are handed out: a prompt copies the hashes of the prefix it shares
and takes fresh ids from a counter for everything after, so a hash is never reused
behind a different prefix. The blocks of turn k's answer have no id in the workload's
own counter: the engine names them ``derived_block_hash(previous hash, request id of
turn k, block index)`` when turn k stores them, and turn k+1's prompt carries the same
derived hashes, so it hits what turn k stored (the Mooncake trace cannot: its ids cover
prompts only, see docs/policies.md).

Everything random comes from one ``random.Random(seed)``, and nothing hashes strings or
iterates unordered sets, so the same arguments give the same list in every process.
"""

from __future__ import annotations

import heapq
import random

from kvlife.lifecycle.config import BURST_SPREAD_ARRIVALS, SYNTHETIC_RULES
from kvlife.lifecycle.engine.blocks import extend_hashes
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest, WorkloadSummary, describe

__all__ = ["WorkloadSummary", "describe", "synthetic_workload"]

# Rough speed of one serving instance, used only to place a session's next turn after
# its previous answer could have arrived; the simulator models the real latencies.
_PREFILL_TOKENS_PER_MS = 10.0
_DECODE_MS_PER_TOKEN = 25.0


def _estimated_service_ms(input_length: int, output_length: int) -> float:
    return input_length / _PREFILL_TOKENS_PER_MS + output_length * _DECODE_MS_PER_TOKEN



def _check(name: str, value: object) -> None:
    """One option under its rule (``kvlife.lifecycle.config.SYNTHETIC_RULES``). ValueError,
    not TypeError, so that callers catch one type for any bad argument."""
    problem = SYNTHETIC_RULES[name].problem(value)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


def _check_pair(name: str, value: object) -> None:
    """An inclusive range (low, high): a pair, each element under the option's rule, low <= high."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"{name}: expected a pair (low, high), got {value!r}")
    for element in value:
        _check(name, element)
    if value[0] > value[1]:
        raise ValueError(f"{name}: expected low <= high, got {value!r}")


def _check_stream(seed: object, num_requests: object, block_tokens: object, arrival_rate_per_s: object) -> None:
    """The arguments every generator takes."""
    _check("seed", seed)
    _check("num_requests", num_requests)
    _check("block_tokens", block_tokens)
    _check("arrival_rate_per_s", arrival_rate_per_s)


def synthetic_workload(
    *,
    seed: int = 0,
    num_requests: int = 400,
    block_tokens: int = 512,
    arrival_rate_per_s: float = 4.0,
    num_system_prompts: int = 4,
    system_prompt_blocks: tuple[int, int] = (2, 6),
    session_probability: float = 0.5,
    max_turns: int = 4,
    user_tokens: tuple[int, int] = (200, 3000),
    output_tokens: tuple[int, int] = (20, 600),
    think_time_s: tuple[float, float] = (2.0, 20.0),
) -> list[WorkloadRequest]:
    """Generate ``num_requests`` requests sorted by arrival, ids ``req-{index}``.

    Conversations start as a Poisson process; each is a session with probability
    ``session_probability`` (2 to ``max_turns`` turns, ``session`` set to ``s-{n}``) or
    else a single request with ``session=None``. Conversation starts are thinned by the
    mean turns per conversation, so ``arrival_rate_per_s`` is the long-run rate of all
    requests, follow-up turns included. Each conversation opens with one of
    ``num_system_prompts`` system prompts (none if 0). Ranges are inclusive and drawn
    uniformly. Turn k+1 arrives at turn k's arrival plus a rough service-time estimate
    plus a think time. The result is the first ``num_requests`` arrivals of that stream,
    so sessions still running at the end of the window are cut short.
    """
    _check_stream(seed, num_requests, block_tokens, arrival_rate_per_s)
    _check("num_system_prompts", num_system_prompts)
    _check_pair("system_prompt_blocks", system_prompt_blocks)
    _check("session_probability", session_probability)
    _check("max_turns", max_turns)
    _check_pair("user_tokens", user_tokens)
    _check_pair("output_tokens", output_tokens)
    _check_pair("think_time_s", think_time_s)

    rng = random.Random(seed)
    next_hash = 0

    def fresh_hashes(count: int) -> list[int]:
        nonlocal next_hash
        start = next_hash
        next_hash += count
        return list(range(start, next_hash))

    system_prompts = [
        fresh_hashes(rng.randint(*system_prompt_blocks))
        for _ in range(num_system_prompts)
    ]

    min_session_turns = min(2, max_turns)
    mean_turns = (1 - session_probability) + session_probability * (
        (min_session_turns + max_turns) / 2
    )
    starts_per_ms = arrival_rate_per_s / 1000.0 / mean_turns

    # (arrival_ms, generation order, input_length, output_length, own hash ids, session,
    # previous turn's generation order or -1). A follow-up turn's hash ids are its previous
    # turn's full prompt blocks, the blocks that turn's answer filled, then its own ids;
    # the middle part depends on the previous turn's request id, known after sorting.
    drafts: list[tuple[float, int, int, int, tuple[int, ...], str | None, int]] = []
    # The workload is the first num_requests arrivals of an endless stream, like a window
    # cut from a production trace: stopping at a request count instead would leave the
    # tail made only of late follow-up turns, at a fraction of the intended rate. This
    # max-heap (negated) keeps the num_requests earliest arrivals seen so far; once a
    # conversation starts after the latest of them, no later one can displace any.
    earliest: list[float] = []
    start_ms = 0.0
    sessions = 0
    while num_requests:
        if drafts:
            start_ms += rng.expovariate(starts_per_ms)
        if len(earliest) == num_requests and start_ms > -earliest[0]:
            break
        session: str | None = None
        turns = 1
        if rng.random() < session_probability:
            session = f"s-{sessions}"
            sessions += 1
            turns = rng.randint(min_session_turns, max_turns)

        # The reusable part of the context: hashes of full blocks only, since a partial
        # block's content changes as soon as more tokens follow it.
        shared = list(rng.choice(system_prompts)) if system_prompts else []
        context_tokens = len(shared) * block_tokens
        context_blocks = len(shared)  # blocks of the context with a hash (full ones)
        arrival_ms = start_ms
        previous = -1  # generation order of the turn this one continues
        for _ in range(turns):
            input_length = context_tokens + rng.randint(*user_tokens)
            output_length = rng.randint(*output_tokens)
            new_blocks = -(-input_length // block_tokens) - context_blocks
            own = tuple(fresh_hashes(new_blocks))
            if previous < 0:
                own = tuple(shared) + own
            arrival = round(arrival_ms, 3)
            drafts.append((arrival, len(drafts), input_length, output_length, own, session, previous))
            previous = len(drafts) - 1
            if len(earliest) < num_requests:
                heapq.heappush(earliest, -arrival)
            elif arrival < -earliest[0]:
                heapq.heapreplace(earliest, -arrival)
            arrival_ms += _estimated_service_ms(input_length, output_length)
            arrival_ms += rng.uniform(*think_time_s) * 1000.0
            context_tokens = input_length + output_length
            context_blocks = context_tokens // block_tokens

    drafts.sort(key=lambda draft: (draft[0], draft[1]))
    del drafts[num_requests:]
    # Request ids follow arrival order; a follow-up turn always arrives after the turn it
    # continues, so that turn is kept and named before it.
    names = {draft[1]: f"req-{index}" for index, draft in enumerate(drafts)}
    by_order = {draft[1]: draft for draft in drafts}
    hashes_of: dict[int, tuple[int, ...]] = {}
    out = []
    for draft in sorted(drafts, key=lambda d: d[1]):
        arrival, order, input_length, output_length, own, session, parent = draft
        hash_ids = own
        if parent >= 0:
            turn = by_order[parent]
            full = hashes_of[parent][: turn[2] // block_tokens]
            context = extend_hashes(full, names[parent], (turn[2] + turn[3]) // block_tokens)
            hash_ids = context + own
        hashes_of[order] = hash_ids
        out.append(
            WorkloadRequest(
                request_id=names[order],
                arrival_ms=arrival,
                input_length=input_length,
                output_length=output_length,
                hash_ids=hash_ids,
                session=session,
            )
        )
    return sorted(out, key=lambda r: int(r.request_id[4:]))


def synthetic_burst_workload(
    *,
    seed: int = 0,
    num_requests: int = 400,
    block_tokens: int = 512,
    arrival_rate_per_s: float = 4.0,
    prefix_blocks: tuple[int, int] = (16, 48),
    burst_size: tuple[int, int] = (4, 16),
    own_tokens: tuple[int, int] = (100, 1500),
    output_tokens: tuple[int, int] = (20, 300),
    topics_between: int = 32,
    burst_spread_ms: float = 20.0,
) -> list[WorkloadRequest]:
    """Flash crowds on shared documents: concurrent requests for the same prefix, which a
    lower tier holds and the device no longer does (``--workload synthetic:burst``).

    Each *topic* is a fresh run of ``prefix_blocks`` full blocks (a document, a long system
    prompt) that no earlier request shares. Its first request, the *seed*, computes it (and
    the engine stores it to its tiers). After ``topics_between`` further topics have been
    seeded and burst, so that many unrelated blocks have passed through the device since,
    the topic comes back as a *burst*: ``burst_size`` requests arriving within
    ``burst_spread_ms`` of each other, each the prefix plus ``own_tokens`` of its own
    (fresh block ids). Those requests look the prefix up at the same moment: the workload
    where loads of the same blocks coincide (``shared-loads``, ``defer-while-loading``).

    Seeds and bursts alternate once the first ``topics_between`` topics are seeded. A unit
    of k requests (1 for a seed) is followed by k gaps of a Poisson process at
    ``arrival_rate_per_s``, so that is the rate of all requests once bursts run. While the
    first topics are seeded, each seed is followed by 1 + mean burst size gaps: new prefixes
    arrive at the same pace as later (a warm-up of long uncached prompts all at once would
    be a queue of its own). Because the distance from
    a seed to its burst is counted in topics, not seconds, the volume of other blocks in
    between (about ``topics_between`` x (prefix + burst x own) blocks) does not change with
    the arrival rate. Ranges are inclusive and drawn uniformly from one
    ``random.Random(seed)``; ids are ``req-{index}`` in arrival order, ``session`` is None.
    """
    _check_stream(seed, num_requests, block_tokens, arrival_rate_per_s)
    _check_pair("prefix_blocks", prefix_blocks)
    _check_pair("burst_size", burst_size)
    _check_pair("own_tokens", own_tokens)
    _check_pair("output_tokens", output_tokens)
    _check("topics_between", topics_between)
    _check("burst_spread_ms", burst_spread_ms)
    arrivals = burst_spread_ms * arrival_rate_per_s / 1000.0
    if arrivals > BURST_SPREAD_ARRIVALS.value:
        raise ValueError(
            f"burst_spread_ms: {burst_spread_ms:g} ms at {arrival_rate_per_s:g} requests/s spans {arrivals:,.4g} "
            f"arrivals, at most {BURST_SPREAD_ARRIVALS.text()} ({BURST_SPREAD_ARRIVALS.why})"
        )

    rng = random.Random(seed)
    next_hash = 0

    def fresh_hashes(count: int) -> tuple[int, ...]:
        nonlocal next_hash
        start = next_hash
        next_hash += count
        return tuple(range(start, next_hash))

    def request(arrival: float, prefix: tuple[int, ...]) -> tuple[float, int, tuple[int, ...]]:
        own = rng.randint(*own_tokens)
        input_length = len(prefix) * block_tokens + own
        return (round(arrival, 3), input_length, prefix + fresh_hashes(-(-own // block_tokens)))

    per_ms = arrival_rate_per_s / 1000.0
    # (arrival_ms, input_length, hash_ids) in generation order; sorted at the end.
    drafts: list[tuple[float, int, tuple[int, ...]]] = []
    waiting: list[tuple[int, ...]] = []  # seeded topics whose burst has not come yet
    now = 0.0
    latest = 0.0
    size = 0  # gaps after the previous unit: its requests
    bursting = False
    warmup_gaps = round(1 + (burst_size[0] + burst_size[1]) / 2)
    while num_requests:
        # A unit of k requests takes k gaps of a Poisson process at the request rate.
        now += sum(rng.expovariate(per_ms) for _ in range(size))
        # Done once num_requests are drawn and this unit starts after all of them: no
        # later arrival can be among the earliest num_requests.
        if len(drafts) >= num_requests and now > latest:
            break
        if len(waiting) <= topics_between:  # seed a new topic
            prefix = fresh_hashes(rng.randint(*prefix_blocks))
            waiting.append(prefix)
            drafts.append(request(now, prefix))
            latest = max(latest, drafts[-1][0])
            # Once bursts run, a seed and a burst alternate: one seed per 1 + burst gaps.
            # Before (warming up), seeds keep that pace instead of arriving all at once.
            size = 1 if bursting else warmup_gaps
        else:  # the burst of the oldest waiting topic
            bursting = True
            prefix = waiting.pop(0)
            size = rng.randint(*burst_size)
            for _ in range(size):
                drafts.append(request(now + rng.uniform(0.0, burst_spread_ms), prefix))
                latest = max(latest, drafts[-1][0])

    drafts.sort(key=lambda draft: draft[0])  # stable: generation order breaks ties
    del drafts[num_requests:]
    return [
        WorkloadRequest(
            request_id=f"req-{index}",
            arrival_ms=arrival,
            input_length=input_length,
            output_length=rng.randint(*output_tokens),
            hash_ids=hash_ids,
        )
        for index, (arrival, input_length, hash_ids) in enumerate(drafts)
    ]


SYNTHETIC_NAMES = ("synthetic", "synthetic:burst")


def named_synthetic_workload(
    name: str, *, seed: int, num_requests: int, block_tokens: int, arrival_rate_per_s: float
) -> list[WorkloadRequest]:
    """The synthetic workload ``--workload NAME`` names (``SYNTHETIC_NAMES``) with its
    other parameters at their defaults."""
    if name not in SYNTHETIC_NAMES:
        raise ValueError(f"unknown synthetic workload {name!r}: expected one of {', '.join(SYNTHETIC_NAMES)}")
    generate = synthetic_burst_workload if name == "synthetic:burst" else synthetic_workload
    return generate(
        seed=seed, num_requests=num_requests, block_tokens=block_tokens, arrival_rate_per_s=arrival_rate_per_s
    )
