"""The native ``PyRandom`` against Python's ``random.Random``: from the same int seed, the same
calls draw the same numbers bit for bit (floats compared as ``float.hex``), raise the same
exceptions with the same messages, and leave the same generator state (``getstate``).

The simulator draws ``random()`` and ``uniform(0.0, jitter)`` from ``random.Random(sim.seed)``
(lifecycle/drivers/simulator.py) and ``random()``/``uniform`` from ``random.Random(sim.chaos)``
(lifecycle/drivers/chaos.py); the synthetic workloads add ``randint``, ``choice`` and
``expovariate``. The integer draws all go through ``getrandbits``.
"""

from __future__ import annotations

import faulthandler
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

core = pytest.importorskip("kvlife.lifecycle.native._core")


@pytest.fixture(autouse=True)
def _no_native_hang() -> Iterator[None]:
    """A native loop that never ends (a broken _randbelow) holds the GIL: pytest-timeout's signal
    and thread can never run. faulthandler's watchdog is a C thread: it prints the stacks and
    ends the process."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


HANG_S = 120  # a test of this module runs for a few seconds
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT64 = st.integers(INT64_MIN, INT64_MAX)
# Seeds: every int64 (all a config holds), the word boundaries of abs(seed), and larger ints,
# up to more 32-bit words (700) than the twister's state has (624): init_by_array's longer loop.
# The larger ones are drawn as (little-endian bytes, negative): an int of thousands of digits
# is past what a failure report may print (sys.get_int_max_str_digits).
Seed = int | tuple[bytes, bool]
SEEDS: st.SearchStrategy[Seed] = st.one_of(
    st.sampled_from([0, 1, -1, 2**32 - 1, 2**32, -(2**32), INT64_MAX, INT64_MIN, 2**64]),
    INT64,
    st.tuples(st.one_of(st.binary(min_size=9, max_size=300), st.binary(min_size=2500, max_size=2800)), st.booleans()),
)
SMALL_OR_INT64 = st.one_of(st.integers(-20, 20), INT64)
STEPS = st.one_of(st.integers(-3, 3), INT64)
SMALL = st.integers(-40, 40)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)



def _stepped_range(start: int, step: int, count: int, cut: int) -> tuple[int, int, int]:
    """randrange's arguments for a range of ``count`` values, stop short of the next one by
    ``cut`` (less than a step): either direction, n computed by rounding up."""
    cut %= abs(step)
    return start, start + step * count - (cut if step > 0 else -cut), step


Op = tuple[str, tuple[Any, ...]]
# (method, args): every method the native generator mirrors, with arguments that must raise too.
OPS = st.one_of(
    st.tuples(st.just("random"), st.just(())),
    st.tuples(st.just("burst"), st.tuples(st.integers(0, 700))),  # across the 624-word twist
    st.tuples(st.just("uniform"), st.tuples(FLOATS, FLOATS)),
    st.tuples(st.just("uniform"), st.tuples(st.just(0.0), st.floats(0.0, 1e3))),  # the simulator's jitter
    st.tuples(st.just("getrandbits"), st.tuples(st.integers(-3, 70))),
    st.tuples(st.just("getrandbits"), st.tuples(st.integers(65, 3000))),
    st.tuples(st.just("getrandbits"), st.tuples(st.sampled_from([2**31, -(2**31) - 1, 2**64]))),
    st.tuples(st.just("_randbelow"), st.tuples(st.one_of(
        st.integers(1, 2**64 - 1), st.integers(1, 40),
        st.integers(0, 63).flatmap(lambda e: st.sampled_from([2**e, 2**e + 1, 2**(e + 1) - 1]))))),
    st.tuples(st.just("randrange"), st.tuples(SMALL_OR_INT64)),
    st.tuples(st.just("randrange"), st.tuples(SMALL_OR_INT64, SMALL_OR_INT64)),
    st.tuples(st.just("randrange"), st.tuples(SMALL_OR_INT64, SMALL_OR_INT64, STEPS)),
    st.tuples(st.just("randrange"), st.tuples(SMALL, SMALL, st.integers(-9, 9))),
    st.tuples(st.just("randrange"), st.builds(_stepped_range, SMALL, st.integers(-9, 9).filter(bool),
                                              st.integers(1, 30), st.integers(0, 8))),
    st.tuples(st.just("randrange"), st.tuples(st.integers(-5, 5), st.none(), st.sampled_from([1, 2, True]))),
    st.tuples(st.just("randint"), st.tuples(SMALL_OR_INT64, SMALL_OR_INT64)),
    st.tuples(st.just("randint"), st.just((INT64_MIN, INT64_MAX))),  # 2**64 values: a 65-bit _randbelow
    st.tuples(st.just("choice"), st.tuples(st.lists(st.integers(), max_size=40))),
    st.tuples(st.just("shuffle"), st.tuples(st.lists(st.integers(), max_size=40))),
    st.tuples(st.just("expovariate"), st.tuples(st.one_of(FLOATS, st.floats(-10.0, 10.0), st.just(0.0)))),
    st.tuples(st.just("seed"), st.tuples(SEEDS)),
)


def _seed(drawn: Seed) -> int:
    if isinstance(drawn, int):
        return drawn
    magnitude = int.from_bytes(drawn[0], "little")
    return -magnitude if drawn[1] else magnitude


def _value(result: Any) -> Any:
    """A result as compared: floats by their bits, every value with its type."""
    if isinstance(result, float):
        return ("float", result.hex())
    if isinstance(result, list):
        return [_value(item) for item in result]
    return (type(result).__name__, result)


def _outcome(rng: Any, method: str, args: tuple[Any, ...]) -> Any:
    try:
        if method == "burst":
            return _value([rng.random() for _ in range(args[0])])
        if method == "shuffle":
            items = list(args[0])
            assert rng.shuffle(items) is None
            return _value(items)
        if method == "seed":
            return _value(rng.seed(_seed(args[0])))
        return _value(getattr(rng, method)(*args))
    except Exception as exc:  # the reference's exception is part of what must match
        return ("raised", type(exc).__name__, str(exc))


@settings(max_examples=250, deadline=None)
@given(seed=SEEDS, ops=st.lists(OPS, max_size=25))
def test_the_native_generator_draws_what_random_random_draws(seed: Seed, ops: list[Op]) -> None:
    reference = random.Random(_seed(seed))
    native = core.PyRandom(_seed(seed))
    assert native.getstate() == reference.getstate()
    for method, args in ops:
        want = _outcome(reference, method, args)
        got = _outcome(native, method, args)
        assert got == want, (method, args)
        assert native.getstate() == reference.getstate(), (method, args)


def test_a_long_run_of_the_simulators_draws_matches() -> None:
    # The simulator's pattern: a failure roll, then a jitter, many twists of the state over.
    reference, native = random.Random(42), core.PyRandom(42)
    for i in range(5000):
        assert native.random().hex() == reference.random().hex()
        assert native.uniform(0.0, 0.25 * i).hex() == reference.uniform(0.0, 0.25 * i).hex()
    assert native.getstate() == reference.getstate()


def test_where_the_native_generator_stops_short_of_python() -> None:
    native = core.PyRandom(7)
    before = native.getstate()
    # Seeds other than ints: Python hashes a float, SHA-512s a str, reads urandom for None.
    for seed in (1.5, "kvlife", None):
        with pytest.raises(TypeError, match="seeds from an int only"):
            core.PyRandom(seed)
    # Python's _randbelow loops forever on n <= 0; the native one refuses.
    for n in (0, -3):
        with pytest.raises(ValueError, match="needs n > 0"):
            native._randbelow(n)
    # Bounds past int64 (Python's ints are unbounded): OverflowError, before any draw.
    with pytest.raises(OverflowError, match="outside int64"):
        native.randrange(2**63)
    with pytest.raises(OverflowError, match="outside int64"):
        native.randint(0, 2**63)
    with pytest.raises(OverflowError):
        native._randbelow(2**64)
    assert native.getstate() == before
