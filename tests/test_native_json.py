"""The native JSON writer against orjson, the trace's renderer (``trace.pipeline()``): the same
bytes for every double (shortest digits, where fixed notation turns to exponent notation at
both ends, the exponent's form, -0.0, NaN and infinities), every 64-bit integer, any text
(escapes, DEL, U+2028/U+2029, non-ASCII written as UTF-8), nested records, and every record
of the golden traces; and the same TypeError, message included, where orjson refuses."""

from __future__ import annotations

import gzip
import math
import random
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.traces.trace import render_record

_core = pytest.importorskip("kvlife.lifecycle.native._core")
render = _core.render
render_lines = _core.render_lines

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"


def _double(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


def _same(value: Any) -> None:
    assert render(value) == orjson.dumps(value)


def _near(x: float, ulps: int = 3) -> list[float]:
    """x and its neighbours up to ``ulps`` steps either side (finite ones)."""
    out = [x]
    up = down = x
    for _ in range(ulps):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        out += [up, down]
    return [v for v in out if math.isfinite(v)]


# Every kind of double: Hypothesis's own float strategy (edge cases first), any bit pattern
# (NaN payloads and subnormals included), subnormals alone, short decimals at every decimal
# exponent (both fixed/exponent thresholds among them), integers as floats up to and past 1e17.
_bits = st.integers(0, (1 << 64) - 1).map(_double)
_subnormal = st.integers(1, (1 << 52) - 1).map(_double)
_decimal = st.builds(lambda d, k, neg: float(f"{'-' if neg else ''}{d}e{k}"),
                     st.integers(1, 99_999), st.integers(-330, 310), st.booleans())
_integral = st.integers(-(1 << 70), 1 << 70).map(float)
_ulp_steps = st.builds(lambda x, n: _near(x, n)[-1], st.sampled_from([1e-5, 1e-6, 1e15, 1e16, 1e17, 1.0, 0.1]),
                       st.integers(1, 50))
DOUBLES = st.one_of(st.floats(), _bits, _subnormal, _decimal, _integral, _ulp_steps)


@settings(max_examples=2000, deadline=None)
@given(DOUBLES)
@example(1e-5).via("the smallest exponent written in fixed notation")
@example(9.999999999999999e-6).via("just below it: exponent notation")
@example(1e16).via("the smallest in exponent notation, with an explicit +")
@example(9999999999999998.0).via("the largest integral double below it: fixed")
@example(123456789012345680.0)
@example(-0.0)
@example(5e-324)
@example(2.2250738585072014e-308)
@example(1.7976931348623157e308)
@example(math.nan)
@example(-math.inf)
def test_a_double_renders_as_orjson_renders_it(value: float) -> None:
    _same(value)
    _same([value, -value])


def test_doubles_at_every_power_of_ten_and_of_two_render_as_orjson_renders_them() -> None:
    # Where the digits change length and where the binary exponent steps: each boundary and
    # three doubles either side, in one list (one call each way).
    values = [v for k in range(-325, 309) for v in _near(float(f"1e{k}"))]
    values += [v for k in range(-1074, 1024) for v in _near(math.ldexp(1.0, k))]
    values += [-v for v in values]
    got, want = render(values), orjson.dumps(values)
    if got != want:
        diff = next(v for v in values if render(v) != orjson.dumps(v))
        pytest.fail(f"{diff!r}: native {render(diff)!r}, orjson {orjson.dumps(diff)!r}")


def test_random_bit_patterns_render_as_orjson_renders_them() -> None:
    # Hypothesis's examples above, and in bulk: 200,000 doubles from a fixed seed in one list.
    count = 200_000
    words = random.Random(23).getrandbits(64 * count).to_bytes(8 * count, "little")
    values = list(struct.unpack(f"<{count}d", words))
    if render(values) != orjson.dumps(values):
        diff = next(v for v in values if render(v) != orjson.dumps(v))
        pytest.fail(f"{diff!r}: native {render(diff)!r}, orjson {orjson.dumps(diff)!r}")


@pytest.mark.parametrize(("value", "text"), [
    (1e-05, b"0.00001"), (1.2345e-05, b"0.000012345"), (1e-07, b"1e-7"), (2.5e-07, b"2.5e-7"),
    (1e16, b"1e+16"), (1.5e16, b"1.5e+16"), (1e15, b"1000000000000000.0"), (12345.678, b"12345.678"),
    (-0.0, b"-0.0"), (0.0, b"0.0"), (1.0, b"1.0"), (1.5e-300, b"1.5e-300"), (1e100, b"1e+100"),
    (math.nan, b"null"), (math.inf, b"null"), (-math.inf, b"null"),
])
def test_the_float_rules_orjson_follows(value: float, text: bytes) -> None:
    # The rules the native writer places digits by, stated once (an orjson that changed them
    # would fail here, not only in the differential tests above).
    assert orjson.dumps(value) == text
    assert render(value) == text


@settings(max_examples=500, deadline=None)
@given(st.integers(-(1 << 63), (1 << 64) - 1))
@example(-(1 << 63)).via("int64's minimum")
@example((1 << 63) - 1)
@example(1 << 63).via("past int64: orjson writes up to uint64's maximum")
@example((1 << 64) - 1)
@example(0)
def test_an_integer_renders_as_orjson_renders_it(value: int) -> None:
    _same(value)
    _same([value, True, False, None])


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.integers(max_value=-(1 << 63) - 1), st.integers(min_value=1 << 64)))
def test_an_integer_past_64_bits_is_refused_as_orjson_refuses_it(value: int) -> None:
    with pytest.raises(TypeError) as want:
        orjson.dumps(value)
    with pytest.raises(TypeError) as got:
        render(value)
    assert str(got.value) == str(want.value)


_ascii = st.text(st.characters(max_codepoint=0x7F))
_specials = st.text(st.sampled_from(['"', "\\", "/", "\x7f", "\u2028", "\u2029", "\x00", "\x0b", "\x1f", "é",
                                     "\U0001f600", "a"]))


@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.text(), _ascii, _specials))
@example("".join(chr(c) for c in range(0x80))).via("every ASCII character, escaped or not")
@example('"\\\b\f\n\r\t\x0b\x7f\u2028\u2029')
def test_text_renders_as_orjson_renders_it_as_value_and_as_key(text: str) -> None:
    _same(text)
    _same({text: text, "": [text]})


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb"])
def test_a_lone_surrogate_is_refused_as_orjson_refuses_it(text: str) -> None:
    for value in (text, {text: 1}, [1, text]):
        with pytest.raises(TypeError) as want:
            orjson.dumps(value)
        with pytest.raises(TypeError) as got:
            render(value)
        assert str(got.value) == str(want.value)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), DOUBLES, st.text(max_size=8))
RECORDS = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.text(max_size=6), inner, max_size=5)),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(RECORDS)
@example({"a": {}, "b": [], "c": [[], {}, [{}]], "d": {"e": [1, {"f": None}]}})
def test_a_nested_record_renders_as_orjson_renders_it(record: Any) -> None:
    _same(record)
    assert render(record, newline=True) == orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
    # Back to back, as the trace's lines are: nothing carries over from one record to the next.
    assert render([record, record]) == orjson.dumps([record, record])
    assert render_lines([record, record]) == orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE) * 2


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.glob("*.trace.jsonl.gz")))
def test_every_record_of_a_golden_trace_renders_to_its_line(name: str) -> None:
    data = gzip.decompress((GOLDEN / name).read_bytes())
    lines = data.splitlines(keepends=True)
    assert len(lines) > 1000
    records = [orjson.loads(line) for line in lines]
    # The whole file at once, lines after lines in one buffer, as the native engine writes them.
    got = render_lines(records)
    if got != data:
        for number, (record, line) in enumerate(zip(records, lines, strict=True), 1):
            alone = render(record, newline=True)
            assert alone == line, f"{name}:{number}: native {alone!r}, trace {line!r}"
        pytest.fail(f"{name}: each line renders alone, not one after another: {got[:300]!r}")
    # The trace writer's own pipeline (kind first, structlog's JSONRenderer) on a sample.
    for record in records[:: max(1, len(records) // 200)]:
        assert render(record) == render_record(record)


def test_values_far_larger_than_the_buffer_render_whole() -> None:
    # The writer's buffer starts at 64 KiB (render) or 64 bytes (render_lines) and grows; each
    # of these needs it to grow many times over at once (a control character takes 6 bytes).
    for value in ["\x01" * 3_000_000, {"k" * 1_000_000: ["\n" * 500_000] * 4}, [1.5e-300] * 200_000]:
        _same(value)
        assert render_lines([value, value]) == orjson.dumps(value, option=orjson.OPT_APPEND_NEWLINE) * 2


def _nested(depth: int, container: str) -> Any:
    value: Any = [] if container == "list" else {}
    for _ in range(depth - 1):
        value = [value] if container == "list" else {"a": value}
    return value


class _Float(float):
    pass


class _Tuple(tuple):  # type: ignore[type-arg]
    pass


class _Str(str):
    pass


@pytest.mark.parametrize("value", [
    _nested(255, "list"), _nested(255, "dict"), [_nested(254, "list")], {1: 2}, {_Str("k"): 1}, {(1,): 2},
    {1.5, 2}, b"bytes", 1j, object(), _Float(1.5), _Tuple((1,)), [1, {"a": [2, {3}]}],
])
def test_what_orjson_refuses_is_refused_with_its_message(value: Any) -> None:
    with pytest.raises(TypeError) as want:
        orjson.dumps(value)
    with pytest.raises(TypeError) as got:
        render(value)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("value", [
    _nested(254, "list"), _nested(254, "dict"), _Str("a subclass of str"), {"k": _Str("v")}, True, 2**63 - 1,
])
def test_what_orjson_takes_at_its_limits_renders_the_same(value: Any) -> None:
    _same(value)


def test_lines_rendered_natively_make_the_file_the_trace_writer_makes(tmp_path: Path) -> None:
    """``TraceWriter.write_rendered`` takes whole lines in chunks (as a native run hands
    them over): the file, the line count and ``last_t`` are those of writing each record."""
    from kvlife.lifecycle.traces.trace import TraceWriter

    name = sorted(GOLDEN.glob("*.trace.jsonl.gz"))[0]
    records = [orjson.loads(line) for line in gzip.decompress(name.read_bytes()).splitlines()][:3000]
    one_by_one, chunked = tmp_path / "records.jsonl", tmp_path / "chunks.jsonl"
    with TraceWriter(one_by_one) as writer:
        for record in records:
            writer.record(record)
        expected = (writer.lines, writer.last_t())
    with TraceWriter(chunked) as writer:
        for start in range(0, len(records), 701):
            chunk = records[start:start + 701]
            writer.write_rendered(render_lines(chunk), len(chunk))
        writer.write_rendered(b"", 0)
        assert (writer.lines, writer.last_t()) == expected
        with pytest.raises(ValueError, match="must end with a newline"):
            writer.write_rendered(b'{"kind":"free"}', 1)
    assert chunked.read_bytes() == one_by_one.read_bytes()
    assert expected[1] > 0
