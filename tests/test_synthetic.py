"""The synthetic workload: deterministic, Mooncake-shaped, with real prefix reuse."""

from __future__ import annotations

import itertools
import math
import tempfile
from collections import defaultdict
from pathlib import Path

import attrs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine.blocks import extend_hashes
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest, load_mooncake
from kvlife.lifecycle.workloads.synthetic import describe, synthetic_workload


def check_mooncake_shape(workload: list[WorkloadRequest], block_tokens: int) -> None:
    """Ids in order, sorted arrivals, one hash per block, and chained hashes."""
    assert [r.request_id for r in workload] == [
        f"req-{i}" for i in range(len(workload))
    ]
    arrivals = [r.arrival_ms for r in workload]
    assert arrivals == sorted(arrivals)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for request in workload:
        assert request.input_length >= 1 and request.output_length >= 1
        assert len(request.hash_ids) == math.ceil(request.input_length / block_tokens)
        # Chained: a hash names its whole prefix, so it never shows up behind another.
        for index, block_hash in enumerate(request.hash_ids):
            prefix = request.hash_ids[: index + 1]
            assert prefix_of.setdefault(block_hash, prefix) == prefix


def turns_by_session(
    workload: list[WorkloadRequest],
) -> dict[str, list[WorkloadRequest]]:
    sessions: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for request in workload:
        if request.session is not None:
            sessions[request.session].append(request)
    return sessions


def check_sessions_extend(
    workload: list[WorkloadRequest], block_tokens: int, min_think_ms: float
) -> None:
    for turns in turns_by_session(workload).values():
        for previous, current in itertools.pairwise(turns):
            full = previous.input_length // block_tokens
            assert current.hash_ids[:full] == previous.hash_ids[:full]
            # Then the blocks the previous answer filled, named as the engine names the
            # blocks that turn stores (so this turn can hit them), then fresh ids only.
            context = (previous.input_length + previous.output_length) // block_tokens
            assert current.hash_ids[:context] == extend_hashes(
                previous.hash_ids[:full], previous.request_id, context)
            assert not set(current.hash_ids[full:]) & set(previous.hash_ids)
            assert current.input_length > previous.input_length + previous.output_length
            assert current.arrival_ms >= previous.arrival_ms + min_think_ms


def test_same_seed_same_workload() -> None:
    assert synthetic_workload(seed=7) == synthetic_workload(seed=7)
    assert synthetic_workload() == synthetic_workload(seed=0)


def test_different_seeds_differ() -> None:
    assert synthetic_workload(seed=1) != synthetic_workload(seed=2)


def test_defaults_shape() -> None:
    workload = synthetic_workload()
    assert len(workload) == 400
    check_mooncake_shape(workload, 512)
    check_sessions_extend(workload, 512, min_think_ms=2000.0)


def test_defaults_share_prefixes() -> None:
    workload = synthetic_workload()
    summary = describe(workload)
    assert summary["ideal_hit_rate"] > 0.3
    assert summary["sessions"] > 0
    # System prompts alone give sharing: single-shot requests reuse each other's heads.
    first_blocks = [r.hash_ids[0] for r in workload if r.session is None]
    assert len(set(first_blocks)) <= 4 < len(first_blocks)


def test_system_prompts_are_whole_blocks() -> None:
    workload = synthetic_workload(
        session_probability=0.0, num_system_prompts=1, system_prompt_blocks=(3, 3)
    )
    heads = {r.hash_ids[:3] for r in workload}
    assert len(heads) == 1
    assert all(r.input_length > 3 * 512 for r in workload)


def test_sessions_extend_their_prefix() -> None:
    workload = synthetic_workload(seed=3, session_probability=1.0, max_turns=6)
    sessions = turns_by_session(workload)
    assert len(sessions) > 10
    assert max(len(turns) for turns in sessions.values()) >= 3
    check_sessions_extend(workload, 512, min_think_ms=2000.0)


def test_no_sharing_without_system_prompts_or_sessions() -> None:
    workload = synthetic_workload(num_system_prompts=0, session_probability=0.0)
    summary = describe(workload)
    assert summary["ideal_hit_rate"] == 0.0
    assert summary["sessions"] == 0
    assert all(r.session is None for r in workload)


def test_single_turn_sessions() -> None:
    workload = synthetic_workload(session_probability=1.0, max_turns=1)
    assert all(r.session is not None for r in workload)
    assert all(len(turns) == 1 for turns in turns_by_session(workload).values())


def test_zero_requests() -> None:
    assert synthetic_workload(num_requests=0) == []
    assert describe([])["requests"] == 0


def test_long_run_arrival_rate() -> None:
    workload = synthetic_workload(seed=5, num_requests=6000, arrival_rate_per_s=8.0)
    # Follow-up turns take a while to ramp up, so measure the second half.
    half = workload[len(workload) // 2 :]
    rate = (len(half) - 1) / ((half[-1].arrival_ms - half[0].arrival_ms) / 1000.0)
    assert 7.0 < rate < 9.0


def test_round_trips_through_mooncake_file() -> None:
    workload = synthetic_workload(seed=11, block_tokens=256)
    lines = [
        orjson.dumps(
            {
                "timestamp": r.arrival_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            }
        )
        for r in workload
    ]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "synthetic.jsonl"
        path.write_bytes(b"\n".join(lines))
        loaded = load_mooncake(path, block_tokens=256)
    assert loaded == [attrs.evolve(r, session=None) for r in workload]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": 1.5}, "seed"),
        ({"seed": None}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"num_requests": -1}, "num_requests"),
        ({"num_requests": 10.0}, "num_requests"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"arrival_rate_per_s": 0.0}, "arrival_rate_per_s"),
        ({"arrival_rate_per_s": math.inf}, "arrival_rate_per_s"),
        ({"arrival_rate_per_s": math.nan}, "arrival_rate_per_s"),
        ({"num_system_prompts": -1}, "num_system_prompts"),
        ({"system_prompt_blocks": (0, 3)}, "system_prompt_blocks"),
        ({"system_prompt_blocks": (4, 3)}, "system_prompt_blocks"),
        ({"system_prompt_blocks": (1, 2, 3)}, "system_prompt_blocks"),
        ({"system_prompt_blocks": [1, 3]}, "system_prompt_blocks"),
        ({"session_probability": -0.1}, "session_probability"),
        ({"session_probability": 1.5}, "session_probability"),
        ({"session_probability": math.nan}, "session_probability"),
        ({"max_turns": 0}, "max_turns"),
        ({"user_tokens": (0, 10)}, "user_tokens"),
        ({"user_tokens": (10.0, 20.0)}, "user_tokens"),
        ({"output_tokens": (5, 4)}, "output_tokens"),
        ({"think_time_s": (-1.0, 2.0)}, "think_time_s"),
        ({"think_time_s": (3.0, 2.0)}, "think_time_s"),
        ({"think_time_s": (1.0, math.inf)}, "think_time_s"),
    ],
)
def test_validation_names_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: "):
        synthetic_workload(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    num_requests=st.integers(0, 120),
    block_tokens=st.sampled_from([1, 16, 64, 512]),
    num_system_prompts=st.integers(0, 5),
    system_prompt_blocks=st.tuples(st.integers(1, 4), st.integers(0, 4)).map(
        lambda pair: (pair[0], pair[0] + pair[1])
    ),
    session_probability=st.floats(0.0, 1.0),
    max_turns=st.integers(1, 6),
    user_tokens=st.tuples(st.integers(1, 700), st.integers(0, 700)).map(
        lambda pair: (pair[0], pair[0] + pair[1])
    ),
    think_time_s=st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0)).map(
        lambda pair: (pair[0], pair[0] + pair[1])
    ),
)
def test_invariants_hold_for_any_parameters(
    seed: int,
    num_requests: int,
    block_tokens: int,
    num_system_prompts: int,
    system_prompt_blocks: tuple[int, int],
    session_probability: float,
    max_turns: int,
    user_tokens: tuple[int, int],
    think_time_s: tuple[float, float],
) -> None:
    def generate() -> list[WorkloadRequest]:
        return synthetic_workload(
            seed=seed,
            num_requests=num_requests,
            block_tokens=block_tokens,
            num_system_prompts=num_system_prompts,
            system_prompt_blocks=system_prompt_blocks,
            session_probability=session_probability,
            max_turns=max_turns,
            user_tokens=user_tokens,
            output_tokens=(1, 300),
            think_time_s=think_time_s,
        )

    workload = generate()
    assert workload == generate()
    assert len(workload) == num_requests
    check_mooncake_shape(workload, block_tokens)
    # Arrivals are rounded to the microsecond, hence the slack.
    check_sessions_extend(workload, block_tokens, think_time_s[0] * 1000.0 - 0.002)
    assert all(len(turns) <= max_turns for turns in turns_by_session(workload).values())
