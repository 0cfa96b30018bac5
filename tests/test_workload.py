"""The Mooncake trace reader: good files, every kind of bad line, limit and time scale,
the bundled trace by name, and gzip-compressed workloads and traces."""

from __future__ import annotations

import gzip
import math
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlife.lifecycle.traces.trace import TraceError, read_trace
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.bundled import BUNDLED, resolve_workload
from kvlife.lifecycle.workloads.mooncake import (
    WorkloadError,
    WorkloadRequest,
    describe,
    load_mooncake,
)

# The bundled Mooncake conversation trace, as the reader resolves its name.
BUNDLED_TRACE = resolve_workload("mooncake-conversation")

GOOD = (
    '{"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]}'
)


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


_DROP = object()  # marks a field to leave out of record()


def record(**fields: object) -> str:
    base: dict[str, object] = {
        "timestamp": 10,
        "input_length": 600,
        "output_length": 7,
        "hash_ids": [4, 5],
    }
    base.update(fields)
    return orjson.dumps({k: v for k, v in base.items() if v is not _DROP}).decode()


def test_good_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        GOOD,
        "",
        "   ",
        '{"timestamp": 10.5, "input_length": 512, "output_length": 1, "hash_ids": [1],'
        ' "extra": {"ignored": true}}',
        '{"timestamp": 10.5, "input_length": 513, "output_length": 2, "hash_ids": [1, 9]}',
    )
    assert load_mooncake(path) == [
        WorkloadRequest("req-0", 0.0, 1200, 5, (1, 2, 3)),
        WorkloadRequest("req-1", 10.5, 512, 1, (1,)),
        WorkloadRequest("req-2", 10.5, 513, 2, (1, 9)),
    ]


def test_request_is_frozen_and_arrival_is_float(tmp_path: Path) -> None:
    (request,) = load_mooncake(write(tmp_path, GOOD))
    assert type(request.arrival_ms) is float
    assert request.session is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        request.input_length = 3  # type: ignore[misc]


def test_block_tokens_sets_expected_hash_count(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)  # 1200 tokens: 3 blocks of 512, 10 of 128
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path, block_tokens=128)
    assert str(excinfo.value) == (
        f"{path}:1: field 'hash_ids': expected 10 block hashes for input_length 1200, got 3"
    )
    assert len(load_mooncake(path, block_tokens=400)[0].hash_ids) == 3


@pytest.mark.parametrize(
    ("bad_line", "field", "message"),
    [
        ('["not", "an", "object"]', None, "expected a JSON object, got list"),
        (record(timestamp=_DROP), "timestamp", "missing"),
        (record(input_length=_DROP), "input_length", "missing"),
        (record(output_length=_DROP), "output_length", "missing"),
        (record(hash_ids=_DROP), "hash_ids", "missing"),
        (record(timestamp="10"), "timestamp", "must be a non-negative number, got '10'"),
        (record(timestamp=True), "timestamp", "must be a non-negative number, got true"),
        (record(timestamp=None), "timestamp", "must be a non-negative number, got null"),
        (record(timestamp=-1), "timestamp", "must be a non-negative number, got -1"),
        (record(timestamp=-0.5), "timestamp", "must be a non-negative number, got -0.5"),
        (record(input_length="600"), "input_length", "must be a positive integer, got '600'"),
        (record(input_length=600.0), "input_length", "must be a positive integer, got 600.0"),
        (record(input_length=True), "input_length", "must be a positive integer, got true"),
        (record(input_length=0), "input_length", "must be a positive integer, got 0"),
        (
            record(output_length=False),
            "output_length",
            "must be a positive integer, got false",
        ),
        (record(output_length=-3), "output_length", "must be a positive integer, got -3"),
        (record(output_length=[1]), "output_length", "must be a positive integer, got an array"),
        (record(hash_ids="4,5"), "hash_ids", "expected a list of integers, got str"),
        (
            record(hash_ids={"a": 1}),
            "hash_ids",
            "expected a list of integers, got dict",
        ),
        (
            record(hash_ids=[4, -5]),
            "hash_ids",
            "element 1: must be a non-negative integer, got -5",
        ),
        (
            record(hash_ids=[True, 5]),
            "hash_ids",
            "element 0: must be a non-negative integer, got true",
        ),
        (
            record(hash_ids=[4, 5.0]),
            "hash_ids",
            "element 1: must be a non-negative integer, got 5.0",
        ),
        (
            record(hash_ids=[4, "5"]),
            "hash_ids",
            "element 1: must be a non-negative integer, got '5'",
        ),
        (
            record(input_length=1200, hash_ids=[1, 2]),
            "hash_ids",
            "expected 3 block hashes for input_length 1200, got 2",
        ),
        (
            record(input_length=1024, hash_ids=[1, 2, 3]),
            "hash_ids",
            "expected 2 block hashes for input_length 1024, got 3",
        ),
        (
            record(timestamp=9.5),
            "timestamp",
            "9.5 is earlier than 10 on line 2; timestamps must not decrease",
        ),
    ],
)
def test_bad_line_names_file_line_and_field(
    tmp_path: Path, bad_line: str, field: str | None, message: str
) -> None:
    # The good first line sets the previous timestamp to 10; the blank line checks that
    # line numbers are physical lines, not request indices.
    path = write(tmp_path, GOOD, record(), "", bad_line, GOOD)
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    error = excinfo.value
    assert (error.path, error.line, error.field, error.message) == (
        str(path),
        4,
        field,
        message,
    )
    where = f"{path}:4: " if field is None else f"{path}:4: field '{field}': "
    assert str(error) == where + message


def test_decreasing_timestamp_message(tmp_path: Path) -> None:
    path = write(
        tmp_path, record(timestamp=20), record(timestamp=20), record(timestamp=3)
    )
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    assert str(excinfo.value) == (
        f"{path}:3: field 'timestamp': 3 is earlier than 20 on line 2; "
        "timestamps must not decrease"
    )


@pytest.mark.parametrize(
    "bad_line",
    ["{not json", '{"timestamp": 1,}', "NaN", '{"timestamp": 1e400}', "\x00"],
)
def test_invalid_json(tmp_path: Path, bad_line: str) -> None:
    path = write(tmp_path, GOOD, bad_line)
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    error = excinfo.value
    assert (error.line, error.field) == (2, None)
    assert str(error).startswith(f"{path}:2: invalid JSON: ")
    assert "\n" not in str(error)


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    assert str(excinfo.value).startswith(f"{path}:2: invalid JSON: ")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    error = excinfo.value
    assert (error.line, error.field) == (None, None)
    assert str(error) == f"{path}: cannot read: No such file or directory"


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(tmp_path)
    assert str(excinfo.value) == f"{tmp_path}: cannot read: Is a directory"


def test_error_str_is_one_line_and_pickles() -> None:
    error = WorkloadError("t.jsonl", 3, "hash_ids", "first\nsecond")
    assert str(error) == "t.jsonl:3: field 'hash_ids': first second"
    assert str(WorkloadError("t.jsonl", None, "x", "m")) == "t.jsonl: field 'x': m"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.line, copy.field, copy.message) == (
        "t.jsonl",
        3,
        "hash_ids",
        "first\nsecond",
    )


def test_limit_stops_reading(tmp_path: Path) -> None:
    # Line 4 is broken: with a limit of 2 requests the reader must never reach it.
    path = write(tmp_path, GOOD, "", record(), "{broken")
    assert [r.request_id for r in load_mooncake(path, limit=2)] == ["req-0", "req-1"]
    assert load_mooncake(path, limit=0) == []
    assert len(load_mooncake(path, limit=1)) == 1
    with pytest.raises(WorkloadError):
        load_mooncake(path, limit=3)


def test_limit_beyond_end(tmp_path: Path) -> None:
    assert len(load_mooncake(write(tmp_path, GOOD, record()), limit=100)) == 2


def test_time_scale_divides_arrivals(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, record(timestamp=10), record(timestamp=25))
    assert [r.arrival_ms for r in load_mooncake(path, time_scale=2.0)] == [
        0.0,
        5.0,
        12.5,
    ]
    assert [r.arrival_ms for r in load_mooncake(path, time_scale=0.5)] == [
        0.0,
        20.0,
        50.0,
    ]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"limit": -1}, "limit"),
        ({"limit": 1.5}, "limit"),
        ({"limit": True}, "limit"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"block_tokens": 512.0}, "block_tokens"),
        ({"time_scale": 0}, "time_scale"),
        ({"time_scale": -1.0}, "time_scale"),
        ({"time_scale": math.nan}, "time_scale"),
        ({"time_scale": math.inf}, "time_scale"),
        ({"time_scale": True}, "time_scale"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: "):
        load_mooncake(write(tmp_path, GOOD), **kwargs)  # type: ignore[arg-type]


def test_describe_counts() -> None:
    workload = [
        WorkloadRequest("a", 0.0, 1024, 10, (1, 2)),
        WorkloadRequest("b", 1.0, 1500, 20, (1, 2, 3), session="s"),
        WorkloadRequest("c", 2.0, 100, 30, (4,), session="s"),
        WorkloadRequest("d", 3.0, 600, 40, (1, 5), session="t"),
    ]
    assert describe(workload) == {
        "requests": 4,
        "sessions": 2,
        "input_tokens": 3224,
        "output_tokens": 100,
        "prompt_blocks": 8,
        "unique_blocks": 5,
        "repeated_blocks": 3,
        "ideal_hit_rate": 3 / 8,
    }
    assert describe([])["ideal_hit_rate"] == 0.0


@given(
    block_tokens=st.sampled_from([16, 256, 512]),
    rows=st.lists(
        st.tuples(
            st.integers(0, 10_000) | st.floats(0, 10_000, allow_nan=False),
            st.integers(1, 5_000),
            st.integers(1, 2_000),
            st.integers(0, 2**63),
        ),
        max_size=15,
    ),
)
def test_valid_files_round_trip(
    block_tokens: int, rows: list[tuple[float, int, int, int]]
) -> None:
    def hashes(first: int, input_length: int) -> list[int]:
        return list(range(first, first + -(-input_length // block_tokens)))

    rows = sorted(rows, key=lambda row: row[0])
    lines = [
        orjson.dumps(
            {
                "timestamp": timestamp,
                "input_length": input_length,
                "output_length": output_length,
                "hash_ids": hashes(first, input_length),
            }
        )
        for timestamp, input_length, output_length, first in rows
    ]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.jsonl"
        path.write_bytes(b"\n".join(lines))
        loaded = load_mooncake(path, block_tokens=block_tokens)
    assert loaded == [
        WorkloadRequest(
            f"req-{index}",
            float(timestamp),
            input_length,
            output_length,
            tuple(hashes(first, input_length)),
        )
        for index, (timestamp, input_length, output_length, first) in enumerate(rows)
    ]


def test_bundled_trace_head() -> None:
    workload = load_mooncake("mooncake-conversation", limit=500)
    assert len(workload) == 500
    assert workload[0] == WorkloadRequest("req-0", 0.0, 6758, 500, tuple(range(14)))
    assert [r.request_id for r in workload] == [f"req-{i}" for i in range(500)]
    arrivals = [r.arrival_ms for r in workload]
    assert arrivals == sorted(arrivals)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in workload)
    # The trace is a chat service: its prompts share prefixes, which is why it is here.
    assert describe(workload)["ideal_hit_rate"] > 0.1


def test_bundled_trace_loads_whole() -> None:
    assert BUNDLED_TRACE.is_file() and BUNDLED_TRACE.name == BUNDLED["mooncake-conversation"]
    workload = load_mooncake("mooncake-conversation")
    assert len(workload) == 12_031
    # The first two lines of the file, field by field.
    assert workload[0] == WorkloadRequest("req-0", 0.0, 6758, 500, tuple(range(14)))
    assert workload[1] == WorkloadRequest("req-1", 0.0, 7322, 490, (0, *range(14, 28)))
    last = workload[-1]
    assert (last.request_id, last.arrival_ms, last.input_length, last.output_length) == (
        "req-12030", 3536999.0, 20774, 508
    )
    assert last.hash_ids[:2] == (0, 182750) and len(last.hash_ids) == 41
    # A path to the packaged file reads the same as the name.
    assert load_mooncake(BUNDLED_TRACE, limit=3) == workload[:3]


def test_bundled_name_errors_name_the_packaged_file() -> None:
    # 256-token blocks do not fit the trace's 512-token hashes: the first line is wrong,
    # and the error points into the file that was actually read.
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake("mooncake-conversation", block_tokens=256)
    error = excinfo.value
    assert (error.path, error.line, error.field) == (str(BUNDLED_TRACE), 1, "hash_ids")
    assert str(error) == (
        f"{BUNDLED_TRACE}:1: field 'hash_ids': expected 27 block hashes for input_length 6758, got 14"
    )


def test_unknown_bare_name_lists_bundled_workloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake("mooncake-conversaton")
    assert str(excinfo.value) == (
        "mooncake-conversaton: cannot read: No such file or directory"
        " (and not a bundled workload: mooncake-conversation)"
    )


def gzipped(path: Path) -> Path:
    target = path.with_name(path.name + ".gz")
    target.write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    return target


def test_gzip_reads_the_same_as_plain(tmp_path: Path) -> None:
    plain = write(
        tmp_path,
        GOOD,
        "",
        record(timestamp=20),
        record(timestamp=30.5, input_length=1025, hash_ids=[7, 8, 9]),
    )
    packed = gzipped(plain)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert load_mooncake(packed) == load_mooncake(plain)
    assert len(load_mooncake(packed)) == 3
    assert load_mooncake(packed, limit=2, time_scale=2.0) == load_mooncake(plain, limit=2, time_scale=2.0)


def test_gzip_errors_keep_file_line_and_field(tmp_path: Path) -> None:
    packed = gzipped(write(tmp_path, GOOD, record(output_length=0)))
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(packed)
    assert str(excinfo.value) == f"{packed}:2: field 'output_length': must be a positive integer, got 0"


def test_not_gzip_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl.gz"
    path.write_text(GOOD + "\n")
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(path)
    error = excinfo.value
    assert (error.path, error.line, error.field) == (str(path), None, None)
    assert str(error) == f"{path}: cannot read: corrupt gzip file (Not a gzipped file (b'{{\"'))"


def test_truncated_and_corrupt_gzip_are_one_line(tmp_path: Path) -> None:
    data = gzip.compress(("\n".join([GOOD] * 2000) + "\n").encode(), mtime=0)
    truncated = tmp_path / "truncated.jsonl.gz"
    truncated.write_bytes(data[: len(data) // 2])
    # The reader streams: a limit stops it long before the damage.
    assert len(load_mooncake(truncated, limit=2)) == 2
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(truncated)
    assert str(excinfo.value) == (
        f"{truncated}: cannot read: truncated gzip file (the compressed stream ends early)"
    )
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:])  # bad CRC
    with pytest.raises(WorkloadError) as excinfo:
        load_mooncake(corrupt)
    message = str(excinfo.value)
    assert message.startswith(f"{corrupt}: cannot read: corrupt gzip file (")
    assert "\n" not in message


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvlife", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_cli_runs_the_bundled_workload_by_name(tmp_path: Path) -> None:
    done = _run_cli("run", "--workload", "mooncake-conversation", "--limit", "50", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "mooncake-conversation" in done.stdout and "50 requests" in done.stdout


def test_cli_corrupt_gzip_workload_is_exit_2_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(b"not gzip at all\n")
    done = _run_cli("run", "--workload", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(path) in line and "corrupt gzip file" in line


def test_gzip_trace_reads_and_validates_like_plain(tmp_path: Path) -> None:
    trace = tmp_path / "run.trace.jsonl"
    done = _run_cli("run", "--limit", "30", "--trace", str(trace), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    packed = gzipped(trace)
    assert list(read_trace(packed)) == list(read_trace(trace))
    plain_report, packed_report = validate(trace), validate(packed)
    assert packed_report.findings == plain_report.findings == ()
    assert packed_report.truncated_line is None
    assert packed_report.lines == plain_report.lines
    # A trace cut mid-line is reported as truncated whether or not it is compressed.
    cut = tmp_path / "cut.trace.jsonl"
    cut.write_bytes(trace.read_bytes()[:-10])
    assert validate(gzipped(cut)).truncated_line == validate(cut).truncated_line is not None


def test_corrupt_gzip_trace_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.trace.jsonl.gz"
    path.write_bytes(b"{}\n")
    with pytest.raises(TraceError) as excinfo:
        list(read_trace(path))
    assert str(excinfo.value) == f"{path}: cannot read trace: corrupt gzip file (Not a gzipped file (b'{{}}'))"
