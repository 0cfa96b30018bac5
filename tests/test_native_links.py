"""The native Link and LookupService against the reference (``drivers.links.Link``,
``drivers.lookup_service.LookupService``): random operation sequences drive both, and every
result, error message and observable figure must agree, floats compared by ``float.hex``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.drivers.links import Link, tier_links
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.profiles.catalog import list_profiles, load_hardware

pytest.importorskip("kvlife.lifecycle.native._core")
from kvlife.lifecycle.native import bridge, load  # noqa: E402


def _bits(value: Any) -> Any:
    """A result with every float replaced by its exact bits (tuples and lists kept)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple | list):
        return type(value)(_bits(v) for v in value)
    return value


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "ok", _bits(call(*args, **kwargs))
    except ValueError as exc:
        return "ValueError", str(exc)


def _same(ref: Any, nat: Any, method: str, *args: Any, **kwargs: Any) -> None:
    """Call ``method`` on both: the same result bits, or the same ValueError message."""
    assert _outcome(getattr(nat, method), *args, **kwargs) == _outcome(getattr(ref, method), *args, **kwargs)


# --- links ------------------------------------------------------------------------------------

# Sizes as the simulator makes them (blocks x a rank's share of a 64 MiB block) and any others,
# a few of them negative (refused) and a NaN.
_SIZES = st.one_of(
    st.builds(lambda n, ranks: n * (64 * 2**20 / ranks), st.integers(0, 40), st.sampled_from([1, 2, 4, 8])),
    st.floats(0.0, 4e9),
    st.sampled_from([0.0, 1e6, 2.5e7]),
    st.floats(max_value=-1e-300),
    st.just(math.nan),
)
_GAPS = st.one_of(st.just(0.0), st.floats(0.0, 20.0), st.floats(0.0, 1e-6))
_LINK = st.tuples(
    st.sampled_from(["host->device", "nvme", "network rx"]),
    st.one_of(st.floats(0.5, 200.0), st.sampled_from([1.0, 25.0, 64.0])),
    st.one_of(st.just(0.0), st.floats(0.0, 2.0), st.sampled_from([0.005, 0.08])),
    st.one_of(st.none(), st.floats(0.5, 200.0)),
)
_TID = st.tuples(st.integers(0, 6), st.integers(0, 3))
_LINK_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 3), _TID, _SIZES, _GAPS, st.booleans()),
        # a job's transfers starting at once (big heaps, equal finish tags)
        st.tuples(st.just("burst"), st.integers(0, 3), st.lists(st.tuples(_TID, _SIZES, st.booleans()), max_size=10),
                  _GAPS),
        st.tuples(st.just("next"), st.integers(0, 3)),
        st.tuples(st.just("advance"), st.integers(0, 3), _GAPS),
        # to the next report (the simulator's wake-up) or the next drain, or a few ulps short of it
        st.tuples(st.just("wake"), st.integers(0, 3), st.booleans(), st.integers(0, 4)),
        st.tuples(st.just("back"), st.integers(0, 3), st.one_of(st.floats(1e-9, 50.0), st.floats(1e3, 1e300)),
                  st.booleans()),
        st.tuples(st.just("solo"), st.integers(0, 3), _SIZES, st.booleans()),
    ),
    max_size=80,
)


def _link_state(link: Any) -> tuple[Any, ...]:
    return (link.active, link.in_flight, link.bytes_moved.hex(), _bits(link.next_completion()))


@settings(max_examples=400, deadline=None)
@given(specs=st.lists(_LINK, min_size=1, max_size=3), ops=_LINK_OPS)
def test_links_give_the_same_bits_natively(specs: list[tuple[str, float, float, float | None]],
                                           ops: list[tuple[Any, ...]]) -> None:
    refs = [Link(name, bw, lat, write_bandwidth_gb_s=wbw) for name, bw, lat, wbw in specs]
    nats = [bridge.link(ref) for ref in refs]
    clock = 0.0  # one clock for every link, as in the simulator
    for op in ops:
        kind, i = op[0], op[1] % len(refs)
        ref, nat = refs[i], nats[i]
        if kind == "start":
            _, _, tid, nbytes, gap, write = op
            clock += gap
            _same(ref, nat, "start", tid, nbytes, clock, write=write)
        elif kind == "burst":
            clock += op[3]
            for tid, nbytes, write in op[2]:
                _same(ref, nat, "start", tid, nbytes, clock, write=write)
        elif kind == "next":
            _same(ref, nat, "next_completion")
        elif kind == "advance":
            clock += op[2]
            _same(ref, nat, "advance", clock)
        elif kind == "wake":
            _, _, to_drain, ulps = op
            upcoming = ref.next_completion()
            if upcoming is not None and not math.isnan(upcoming[0]):
                t = upcoming[0] - ref.latency_ms if to_drain else upcoming[0]
                for _ in range(ulps):
                    t = math.nextafter(t, -math.inf)
                clock = max(clock, t)
            _same(ref, nat, "advance", clock)
        elif kind == "back":  # refused where earlier than the link's clock: an advance or a start
            _, _, gap, by_start = op
            if by_start:
                _same(ref, nat, "start", (9, 9), 1.0, clock - gap)
            else:
                _same(ref, nat, "advance", clock - gap)
        else:
            _same(ref, nat, "solo_ms", op[2], write=op[3])
        for r, n in zip(refs, nats, strict=True):
            assert _link_state(n) == _link_state(r)


def test_a_wake_up_a_few_ulps_early_reports_the_drain_then() -> None:
    # Two equal transfers share the link and drain together; a third joins late; the wake-up a
    # few ulps short of a drain reports it at that instant (the slack), as the reference does
    # (no latency: the report is the drain).
    ref = Link("nvme", 7.0, write_bandwidth_gb_s=3.0)
    nat = bridge.link(ref)
    for link in (ref, nat):
        link.start((1, 0), 7e6, 0.0)
        link.start((2, 0), 7e6, 0.0)
        link.start((3, 0), 3e6, 0.5, write=True)
    t = ref.next_completion()[0]
    short = math.nextafter(math.nextafter(t, 0.0), 0.0)
    want = ref.advance(short)
    assert want and want[0][0] == short
    assert _bits(nat.advance(short)) == _bits(want)
    assert _link_state(nat) == _link_state(ref)


def test_the_slack_bound_is_inclusive() -> None:
    # Alone at 1 GB/s (1e6 bytes per ms), 1e-3 bytes drain at exactly 1e-9 ms: the slack at time 0.
    ref = Link("host->device", 1.0)
    nat = bridge.link(ref)
    for link in (ref, nat):
        link.start((1, 0), 1e-3, 0.0)
    assert ref.next_completion() == (1e-9, (1, 0))
    assert ref.advance(0.0) == [(0.0, (1, 0))]
    assert _bits(nat.advance(0.0)) == [(0.0.hex(), (1, 0))]


def test_an_empty_transfer_ties_with_one_paying_latency_and_starts_second() -> None:
    # A drains at 1 ms and pays 0.5 ms of latency; B (no bytes) starts at 1 ms: both report at
    # 1.5 ms, and the tie goes to the one started first, in next_completion and in advance.
    ref = Link("network rx", 1.0, 0.5)
    nat = bridge.link(ref)
    for link in (ref, nat):
        link.start((1, 0), 1e6, 0.0)
        link.advance(1.0)
        link.start((2, 0), 0.0, 1.0)
    assert ref.next_completion() == (1.5, (1, 0))
    assert nat.next_completion() == ref.next_completion()
    assert nat.advance(1.5) == ref.advance(1.5) == [(1.5, (1, 0)), (1.5, (2, 0))]


_BAD_FIGURES = st.one_of(st.floats(-5.0, 50.0), st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf]))


@settings(max_examples=200, deadline=None)
@given(bw=_BAD_FIGURES, lat=_BAD_FIGURES, wbw=st.one_of(st.none(), _BAD_FIGURES))
def test_a_link_refuses_the_same_figures(bw: float, lat: float, wbw: float | None) -> None:
    def build(cls: Any) -> Any:
        link = cls("nic", bw, lat, write_bandwidth_gb_s=wbw)
        return (link.name, _bits(link.bandwidth_gb_s), _bits(link.write_bandwidth_gb_s), _bits(link.latency_ms))

    assert _outcome(build, load().Link) == _outcome(build, Link)


def test_every_catalog_link_has_a_native_twin() -> None:
    for hw in list_profiles()["hardware"]:
        for pair in tier_links(load_hardware(hw)).values():
            for ref in (pair.load, pair.store):
                nat = bridge.link(ref)
                assert (nat.name, nat.bandwidth_gb_s, nat.write_bandwidth_gb_s, nat.latency_ms) == (
                    ref.name, ref.bandwidth_gb_s, ref.write_bandwidth_gb_s, ref.latency_ms)
                assert nat.solo_ms(3e8, write=pair.store_is_write).hex() == \
                    ref.solo_ms(3e8, write=pair.store_is_write).hex()


def test_only_a_fresh_link_or_service_is_bridged() -> None:
    link = Link("host->device", 25.0)
    link.advance(1.0)
    with pytest.raises(ValueError, match="already in use"):
        bridge.link(link)
    service = LookupService(2)
    service.submit(None, 3, 0.0)
    with pytest.raises(ValueError, match="already in use"):
        bridge.lookup_service(service)


# --- lookup service ---------------------------------------------------------------------------

# None (a pass's sync lookup) or (request_id, epoch), with ids that need quoting and escapes.
_LOOKUP_ID = st.one_of(
    st.none(),
    st.tuples(st.builds(lambda n: f"req-{n}", st.integers(0, 10**6)), st.integers(0, 50)),
    st.tuples(st.text(st.characters(max_codepoint=127), max_size=8), st.integers(-5, 2**62)),
    st.tuples(st.sampled_from(["é", "日本", "req-é'\""]), st.integers(0, 3)),
)
_LOOKUP_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), _LOOKUP_ID, st.one_of(st.integers(0, 3000), st.integers(-5, -1)), _GAPS),
        # a burst at one instant (a pass's sync lookups): the workers' queue and finishes out of order
        st.tuples(st.just("burst"), st.lists(st.tuples(_LOOKUP_ID, st.integers(0, 3000)), max_size=12), _GAPS),
        st.tuples(st.just("early"), _LOOKUP_ID, st.integers(-2, 50), st.floats(1e-9, 1e300)),
        st.tuples(st.just("pending"), st.one_of(st.just(0.0), st.floats(0.0, 30.0))),
        st.tuples(st.just("latency"), st.integers(0, 10**6)),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(
    workers=st.one_of(st.integers(1, 4), st.integers(1, 100)),
    base=st.one_of(st.just(0.0), st.just(1.5), st.floats(0.0, 10.0)),
    per_key=st.one_of(st.just(0.0), st.just(0.005), st.floats(0.0, 0.1)),
    ops=_LOOKUP_OPS,
)
def test_lookups_answer_at_the_same_bits_natively(workers: int, base: float, per_key: float,
                                                  ops: list[tuple[Any, ...]]) -> None:
    ref = LookupService(workers, base, per_key)
    nat = bridge.lookup_service(ref)
    clock = 0.0
    for op in ops:
        if op[0] == "submit":
            clock += op[3]
            _same(ref, nat, "submit", op[1], op[2], clock)
        elif op[0] == "burst":
            clock += op[2]
            for lookup_id, keys in op[1]:
                _same(ref, nat, "submit", lookup_id, keys, clock)
        elif op[0] == "early":  # before the last submission: refused (or a negative key count)
            _same(ref, nat, "submit", op[1], op[2], clock - op[3])
        elif op[0] == "pending":  # a query may look ahead of the next submission
            _same(ref, nat, "pending", clock + op[1])
        else:
            _same(ref, nat, "latency_ms", op[1])
        assert (nat.submitted, nat.max_wait_ms.hex()) == (ref.submitted, ref.max_wait_ms.hex())
    assert (nat.workers, nat.base_ms.hex(), nat.per_key_ms.hex()) == (ref.workers, ref.base_ms.hex(),
                                                                      ref.per_key_ms.hex())


@settings(max_examples=100, deadline=None)
@given(
    workers=st.one_of(st.integers(-3, 3), st.booleans(), st.sampled_from([1.0, 2.5])),
    base=_BAD_FIGURES,
    per_key=_BAD_FIGURES,
)
def test_a_lookup_service_refuses_the_same_settings(workers: Any, base: float, per_key: float) -> None:
    def build(cls: Any) -> Any:
        service = cls(workers, base, per_key)
        return (service.workers, _bits(service.base_ms), _bits(service.per_key_ms))

    assert _outcome(build, load().LookupService) == _outcome(build, LookupService)
