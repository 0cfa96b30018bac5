"""Config files: every error is one line naming the file, the line (in the right table when
a table repeats) and the dotted field; keys mirror the long flags of ``kvlife run``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import (
    SIM_DEVICE_BLOCK_BYTES,
    SYNTHETIC_RULES,
    WORKLOAD_RULES,
    ConfigError,
    EngineConfig,
    Limit,
    LiveConfig,
    Rule,
    RunConfig,
    SimConfig,
    TierConfig,
    field_rule,
    key_line,
    load_config,
    memory_limit,
)

ROOT = Path(__file__).resolve().parents[1]


def error_of(tmp_path: Path, text: str, name: str = "kvlife.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value).replace(str(path), "FILE")


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the CLI in-process: exit code 2, one line on stderr, no traceback."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err.rstrip("\n")


def test_missing_config_file_names_the_file_and_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    line = cli_error(capsys, "run", "--config", str(missing))
    assert line == f"kvlife: error: {missing}: cannot read config: No such file or directory"


def test_a_directory_or_binary_file_is_a_clear_read_error(tmp_path: Path) -> None:
    (tmp_path / "empty.toml").write_text("")
    assert load_config(tmp_path / "empty.toml") == RunConfig()  # an empty file: every default
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml: cannot read config: Is a directory$"):
        load_config(tmp_path / "dir.toml")
    (tmp_path / "bin.toml").write_bytes(b"[engine]\n\xff\xfe = 1\n")
    with pytest.raises(ConfigError, match=r"bin\.toml: cannot read config: not UTF-8 text \(byte 9\)$"):
        load_config(tmp_path / "bin.toml")


def test_toml_syntax_error_has_line_and_column_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[engine]\ndevice_blocks = 300\nranks = = 2\n")
    line = cli_error(capsys, "run", "--config", str(path))
    assert line == f"kvlife: error: {path}:3:9: TOML syntax error: Invalid value"
    assert error_of(tmp_path, '[policies]\nstack = ["a",\n') == \
        "FILE:2:14: TOML syntax error: Invalid value at the end of the file"


def test_bad_value_in_the_second_tiers_table_points_at_that_table(tmp_path: Path) -> None:
    text = ('[[tiers]]\nname = "host"\ncapacity_blocks = 100\n\n'
            '[[tiers]]\nname = "disk"\ncapacity_blocks = 0\n')
    assert error_of(tmp_path, text) == "FILE:7: field 'tiers[1].capacity_blocks': must be a positive integer, got 0"
    text = ('[[tiers]]\nname = "host"\ncapacity_blocks = 100\neviction = "lru"\n\n'
            '[[tiers]]\nname = "disk"\ncapacity_blocks = 10\neviction = "fifo"\n')
    assert error_of(tmp_path, text) == \
        "FILE:9: field 'tiers[1].eviction': must be one of 'lru', 'arc'; got 'fifo'"
    # A required key missing: the line of the table that lacks it.
    text = '[[tiers]]\nname = "host"\ncapacity_blocks = 1\n[[tiers]]\nname = "disk"\n'
    assert error_of(tmp_path, text) == ("FILE:4: field 'tiers[1].capacity_blocks': missing (every [[tiers]] "
                                        "table needs name and capacity_blocks)")
    text = '[[tiers]]\nname = "disk"\ncapacity_blocks = 1\n[[tiers]]\nname = "host"\ncapacity_blocks = 1\n'
    assert error_of(tmp_path, text) == ("FILE:5: field 'tiers[1].name': tiers cascade host, disk, remote in that "
                                        "order; got disk, host")
    text = '[[tiers]]\nname = "host"\ncapacity_blocks = 1\n[[tiers]]\nname = "host"\ncapacity_blocks = 1\n'
    assert error_of(tmp_path, text) == \
        "FILE:5: field 'tiers[1].name': tier 'host' is given twice; tier names must be unique"


def test_seed_that_is_not_an_integer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "seed.toml"
    path.write_text('# the seed\n[sim]\nseed = "abc"\n')
    line = cli_error(capsys, "run", "--config", str(path))
    assert line == f"kvlife: error: {path}:3: field 'sim.seed': must be an integer, got 'abc'"
    assert error_of(tmp_path, "sim.seed = 1.5\n") == "FILE:1: field 'sim.seed': must be an integer, got 1.5"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[engine]\ndevice_block = 5\n",
         "FILE:2: field 'engine.device_block': unknown key (did you mean 'device_blocks'?)"),
        ("[sim]\nsed = 5\n", "FILE:2: field 'sim.sed': unknown key (did you mean 'seed'?)"),
        ("[live]\nredis_ttl = 5\n", "FILE:2: field 'live.redis_ttl': unknown key (did you mean 'redis_ttl_s'?)"),
        ("[policies]\nstacks = []\n", "FILE:2: field 'policies.stacks': unknown key (did you mean 'stack'?)"),
        ('[[tiers]]\nname = "host"\ncapacity = 5\n',
         "FILE:3: field 'tiers[0].capacity': unknown key (did you mean 'capacity_blocks'?)"),
        ("[simm]\nseed = 1\n", "FILE:1: field 'simm': unknown section (did you mean 'sim'?)"),
        ("[engine]\ntiers = []\n",
         "FILE:2: field 'engine.tiers': unknown key (tiers are [[tiers]] tables of their own)"),
        ("[engine]\nzzz = 1\n", "FILE:2: field 'engine.zzz': unknown key (known: block_tokens, device_blocks, "
         "max_batched_tokens, max_running, ranks, async_scheduling, transfer_deadline_ms, lookup_latency_ms, "
         "lookup_deadline_ms, reclaim_deadline_ms, max_async_lookups, kv_load_failure_policy)"),
    ],
)
def test_unknown_keys_are_refused_in_every_section(tmp_path: Path, text: str, expected: str) -> None:
    assert error_of(tmp_path, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[engine]\nasync_scheduling = 1\n", "FILE:2: field 'engine.async_scheduling': must be true or false, got 1"),
        ("[engine]\nranks = true\n", "FILE:2: field 'engine.ranks': must be a positive integer, got true"),
        ("[engine]\ndevice_blocks = [1]\n", "FILE:2: field 'engine.device_blocks': must be a positive integer, "
         "got an array"),
        ("[engine]\ntransfer_deadline_ms = \"soon\"\n",
         "FILE:2: field 'engine.transfer_deadline_ms': must be a positive number, got 'soon'"),
        ("[sim]\nlookup_per_key_ms = 1979-05-27\n",
         "FILE:2: field 'sim.lookup_per_key_ms': must be a non-negative number, got a date/time (1979-05-27)"),
        ("[sim]\nmax_output_tokens = 0\n", "FILE:2: field 'sim.max_output_tokens': must be a positive integer, got 0"),
        ("[sim]\ntime_scale = -2.0\n", "FILE:2: field 'sim.time_scale': must be a positive number, got -2.0"),
        ("[live]\ndisk_path = 5\n", "FILE:2: field 'live.disk_path': must be a non-empty string, got 5"),
        ("[live]\nredis_url = \"localhost:6379\"\n",
         "FILE:2: field 'live.redis_url': must be a redis://, rediss:// or unix:// URL, got 'localhost:6379'"),
        ("[live]\nredis_ttl_s = -1\n", "FILE:2: field 'live.redis_ttl_s': must be a non-negative integer, got -1"),
        ("[live]\nverify = \"yes\"\n", "FILE:2: field 'live.verify': must be true or false, got 'yes'"),
        ("[live]\ndtype = \"int8\"\n",
         "FILE:2: field 'live.dtype': must be one of 'float16', 'bfloat16', 'float32'; got 'int8'"),
        ("[policies]\nstack = \"baseline\"\n", "FILE:2: field 'policies.stack': must be an array of policy names, "
         "got 'baseline'"),
        ("engine = 5\n", "FILE:1: field 'engine': must be a table ([engine]), got 5"),
        ("[tiers]\nname = \"host\"\n", "FILE:1: field 'tiers': must be an array of tables ([[tiers]]), got a table"),
        ('[[tiers]]\nname = "hots"\ncapacity_blocks = 1\n',
         "FILE:2: field 'tiers[0].name': must be one of 'host', 'disk', 'remote'; got 'hots'"),
        ('[[tiers]]\nname = "host"\ncapacity_blocks = 1\nfailure_rate = 1.5\n',
         "FILE:4: field 'tiers[0].failure_rate': must be a number from 0 to 1, got 1.5"),
    ],
)
def test_wrong_types_name_file_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    assert error_of(tmp_path, text) == expected


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
def test_nan_and_infinity_are_refused_in_float_fields(tmp_path: Path, value: str) -> None:
    text = f'[[tiers]]\nname = "host"\ncapacity_blocks = 8\n\n[[tiers]]\nname = "disk"\ncapacity_blocks = 8\n' \
           f"bandwidth_gbps = {value}\n"
    message = error_of(tmp_path, text)
    assert message.startswith("FILE:8: field 'tiers[1].bandwidth_gbps': must be a finite number, got ")
    assert error_of(tmp_path, f"[sim]\nmbu = {value}\n").startswith(
        "FILE:2: field 'sim.mbu': must be a finite number")
    assert error_of(tmp_path, f"[engine]\nlookup_latency_ms = {value}\n").startswith(
        "FILE:2: field 'engine.lookup_latency_ms': must be a finite number")


def test_keys_mirror_the_long_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvlife.toml"
    path.write_text(
        '[engine]\ndevice_blocks = 300\nranks = 2\n\n[sim]\nseed = 7\ntime_scale = 2.5\n\n'
        '[live]\ndisk_path = "/var/tmp/kv"\nredis_url = "redis://127.0.0.1:6379/0"\nredis_ttl_s = 0\n\n'
        '[policies]\nstack = ["async-lookup", "shared-loads"]\n'
    )
    config = load_config(path)
    assert (config.engine.device_blocks, config.engine.ranks) == (300, 2)
    assert (config.sim.seed, config.sim.time_scale) == (7, 2.5)
    assert config.live.disk_path == "/var/tmp/kv" and config.live.redis_url == "redis://127.0.0.1:6379/0"
    assert config.live.redis_ttl_s == 0  # no TTL: only when said so
    assert config.policies == ("async-lookup", "shared-loads")
    assert key_line(path, "policies.stack") == 15 and key_line(path, "stack") == 15
    assert key_line(path, "live.redis_ttl_s") == 12


def test_defaults() -> None:
    config = RunConfig()
    assert config.live.redis_ttl_s == 3600 and config.sim.time_scale == 1.0
    assert config.live.disk_path is None and config.live.redis_url is None


def test_programmatic_configs_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^field 'seed': must be an integer, got 'x'$"):
        SimConfig(seed="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="finite"):
        TierConfig("host", capacity_blocks=1, latency_ms=float("nan"))
    with pytest.raises(ConfigError, match="^field 'tiers': tiers cascade"):
        EngineConfig(tiers=(TierConfig("disk", 1), TierConfig("host", 1)))
    with pytest.raises(ConfigError, match="redis_ttl_s"):
        attrs.evolve(LiveConfig(), redis_ttl_s=-5)


def test_comments_strings_and_dotted_keys_do_not_confuse_the_line_finder(tmp_path: Path) -> None:
    text = ('# [[tiers]] in a comment\n[live]\ndisk_path = """\n[[tiers]]\nseed = 1\n"""\n'
            '[sim]\n"seed" = "x"\n')
    assert error_of(tmp_path, text) == "FILE:8: field 'sim.seed': must be an integer, got 'x'"
    assert error_of(tmp_path, '[engine]\nranks = 1\n[sim]\nrank_jitter_ms = 1\nmax_output_tokens = -1\n') == \
        "FILE:5: field 'sim.max_output_tokens': must be a positive integer, got -1"
    assert error_of(tmp_path, 'sim = { seed = "x" }\n') == "FILE:1: field 'sim.seed': must be an integer, got 'x'"


def test_config_error_through_the_command_line_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text('[[tiers]]\nname = "host"\ncapacity_blocks = 10\n\n[[tiers]]\nname = "disk"\n'
                    'capacity_blocks = 10\nlatency_ms = -1\n')
    proc = subprocess.run([sys.executable, "-m", "kvlife", "run", "--config", str(path)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr == (f"kvlife: error: {path}:8: field 'tiers[1].latency_ms': must be a non-negative number, "
                           "got -1\n")


# ---- issue 12, item 4: one rule per field, bounds included ------------------------------------------
def _rules() -> dict[str, Rule]:
    """Every config key and its rule: "engine.ranks", "tiers.failure_rate", ..."""
    found = {f"{section}.{f.alias or f.name}": field_rule(f"{section}.{f.alias or f.name}")
             for section, cls in (("engine", EngineConfig), ("sim", SimConfig), ("live", LiveConfig))
             for f in attrs.fields(cls) if f.name != "tiers"}
    found.update({f"tiers.{f.name}": field_rule(f"tiers.{f.name}") for f in attrs.fields(TierConfig)})
    return found


def _file_for(field: str, value: str) -> tuple[str, str, int]:
    """A config text setting ``field`` to the TOML ``value``: (text, dotted field, its line)."""
    section, _, key = field.partition(".")
    if section == "tiers":
        other = {"name": "capacity_blocks = 10\n", "capacity_blocks": 'name = "host"\n'}.get(
            key, 'name = "host"\ncapacity_blocks = 10\n')
        return f"[[tiers]]\n{other}{key} = {value}\n", f"tiers[0].{key}", 2 + other.count("\n")
    return f"# {field}\n[{section}]\n{key} = {value}\n", field, 3


NUMBER_FIELDS = sorted(field for field, rule in _rules().items() if rule.kind == "number")


def test_every_number_field_is_found() -> None:
    """The 20 float fields of the config (the issue found NaN accepted in 12 of the 13 it had;
    the live runtime's Redis timeout, breaker back-off and stall timeout came later, the
    lookup and reclaim deadlines later still, then gamma arrivals' CV and the request rate)."""
    assert NUMBER_FIELDS == [
        "engine.lookup_deadline_ms", "engine.lookup_latency_ms", "engine.reclaim_deadline_ms",
        "engine.transfer_deadline_ms", "live.redis_breaker_backoff_s",
        "live.redis_timeout_s", "live.stall_timeout_s", "sim.arrival_cv", "sim.attention_efficiency",
        "sim.gpu_memory_utilization", "sim.lookup_per_key_ms", "sim.mbu", "sim.mfu", "sim.rank_jitter_ms",
        "sim.request_rate", "sim.step_overhead_ms", "sim.time_scale", "tiers.bandwidth_gbps", "tiers.failure_rate",
        "tiers.latency_ms"]


@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_infinity_are_refused_in_every_number_field(tmp_path: Path, field: str, value: str) -> None:
    text, dotted, line = _file_for(field, value)
    shown = {"nan": "nan", "inf": "inf", "-inf": "-inf"}[value]
    assert error_of(tmp_path, text) == f"FILE:{line}: field '{dotted}': must be a finite number, got {shown}"


BAD_TYPES = {"int": ['"5"', "2.5", "true", "[1]", "{ a = 1 }", "1979-05-27"],
             "number": ['"5"', "true", "[1]", "{ a = 1 }", "1979-05-27"],
             "bool": ['"false"', '"true"', "0", "1"],
             "choice": ["1", "true", '"nope"'],
             "text": ["1", "true", '""', '"a\\u0000b"'],
             "url": ["1", '"localhost:6379"']}


@pytest.mark.parametrize("field", sorted(_rules()))
def test_bad_types_are_refused_in_every_field(tmp_path: Path, field: str) -> None:
    rule = _rules()[field]
    for value in BAD_TYPES[rule.kind]:
        text, dotted, line = _file_for(field, value)
        message = error_of(tmp_path, text)
        assert message.startswith(f"FILE:{line}: field '{dotted}': must "), (value, message)


@pytest.mark.parametrize(("text", "expected"), [
    ("[sim]\nmax_output_tokens = 0\n", "must be a positive integer, got 0"),
    ("[sim]\nmax_output_tokens = -1\n", "must be a positive integer, got -1"),
    ("[sim]\nmax_output_tokens = 2.5\n", "must be a positive integer, got 2.5"),
    ("[sim]\nmax_output_tokens = true\n", "must be a positive integer, got true"),
    ("[live]\nverify = \"false\"\n", "must be true or false, got 'false'"),
    ("[sim]\nrank_jitter_ms = nan\n", "must be a finite number, got nan"),
    ('[[tiers]]\nname = "host"\ncapacity_blocks = 8\nfailure_rate = 2.0\n', "must be a number from 0 to 1, got 2.0"),
    ("[engine]\nblock_tokens = 1000000000\n", "must be at most 16,777,216 (2^24 tokens, above the longest context "
     "window of any released model (Llama 4 Scout, 10M)), got 1000000000"),
    ("[engine]\nranks = 1000000\n", "must be at most 1,024 (the ranks of one model instance: the largest NVLink "
     "domain, NVL576, has 576 GPUs), got 1000000"),
    ("[sim]\ntp = 2048\n", "must be at most 1,024 (the ranks of one model instance: the largest NVLink domain, "
     "NVL576, has 576 GPUs), got 2048"),
    ("[sim]\ntime_scale = 1e-9\n", "must be at least 1e-06 (a millionth of the recorded arrival rate; slower "
     "pushes arrivals past the clock's range), got 1e-09"),
    ("[sim]\ntime_scale = 1e7\n", "must be at most 1e+06 (a million times the recorded arrival rate), got 10000000.0"),
    ("[sim]\nrank_jitter_ms = 1e10\n", "must be at most 1e+09 (11.6 days in ms: no latency, deadline or step "
     "overhead is longer), got 10000000000.0"),
    ("[sim]\nseed = 9223372036854775808\n", "must be at most 9,223,372,036,854,775,807 (the largest integer JSON "
     "traces hold exactly, signed 64-bit), got 9223372036854775808"),
    ("[live]\nredis_ttl_s = 10000000000000000\n", "must be at most 1,000,000,000,000,000 (seconds: Redis refuses "
     "an expiry whose milliseconds overflow a signed 64-bit integer), got 10000000000000000"),
    ('[[tiers]]\nname = "host"\ncapacity_blocks = 8\nbandwidth_gbps = 1e-9\n', "must be at least 1e-06 (GB/s: "
     "1 kB/s, at which a 64 MiB block takes 18 hours), got 1e-09"),
])
def test_the_issues_cases_are_refused_with_line_field_and_limit(tmp_path: Path, text: str, expected: str) -> None:
    message = error_of(tmp_path, text)
    assert message.endswith(f": {expected}") and message.startswith("FILE:"), message
    field = message.split("field '")[1].split("'")[0]
    assert message.startswith(f"FILE:{text.count(chr(10))}: field '{field}'"), message


def test_memory_bounds_name_this_machines_memory(tmp_path: Path) -> None:
    budget = memory_limit()
    assert budget.value > 0 and "of memory" in budget.why
    most = int(budget.value) // SIM_DEVICE_BLOCK_BYTES
    message = error_of(tmp_path, f"[engine]\ndevice_blocks = {most + 1}\n")
    assert message == (f"FILE:2: field 'engine.device_blocks': must be at most {most:,} (140 B per simulated device "
                       f"block, {budget.why}), got {most + 1}")
    assert field_rule("engine.device_blocks").problem(most) is None


def test_sizes_together_beyond_memory_blame_the_largest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import kvlife.lifecycle.config as config_module

    monkeypatch.setattr(config_module, "memory_limit", lambda: Limit(1_000_000, "a test's 1 MB"))
    text = ('[engine]\ndevice_blocks = 5000\n\n[[tiers]]\nname = "host"\ncapacity_blocks = 8000\n\n'
            '[[tiers]]\nname = "disk"\ncapacity_blocks = 10000\n')
    # 700,000 B of device blocks + 320,000 + 400,000 B of tier slots + a lookup worker: more than 1 MB.
    assert error_of(tmp_path, text) == (
        "FILE:2: field 'engine.device_blocks': 5,000 device blocks of 140 B each need 1.4 MiB with the rest of the "
        "config, more than 976.6 KiB, a test's 1 MB: at most 1,999 fit")
    path = tmp_path / "sizes.toml"
    path.write_text(text.replace("5000", "500"))
    # The same sum from a flag names the flag.
    assert main(["run", "--config", str(path), "--device-blocks", "5000", "--limit", "2"]) == 2
    assert capsys.readouterr().err == (
        "kvlife run: error: argument --device-blocks: 5,000 device blocks of 140 B each need 1.4 MiB with the rest "
        "of the config, more than 976.6 KiB, a test's 1 MB: at most 1,999 fit\n")
    assert main(["run", "--config", str(path), "--tier", "disk=20000", "--limit", "2"]) == 2
    assert capsys.readouterr().err.startswith(
        "kvlife run: error: argument --tier: disk=20000: 20,000 disk tier blocks of 40 B each need ")


def test_live_kv_bytes_beyond_memory_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    # 10 million blocks: live, 4.8 TiB, more than any machine here has; simulated, 1.4 GB of the
    # simulator's own bound (140 B a block, 80 % of the memory available), which even a loaded
    # machine has (at 100 million, a machine with under 16.3 GiB available refused it under
    # that bound first, with another message).
    assert main(["run", "--live", "--device-blocks", "10000000", "--limit", "2"]) == 2
    assert capsys.readouterr().err.startswith(
        "kvlife run: error: argument --device-blocks: 10,000,000 device blocks of 512.1 KiB each (a live KV block: "
        "2 x 2 layers x 4 heads x 32 head_dim x 512 tokens x float16) need 4.8 TiB with the rest of the config, "
        "more than ")
    path = tmp_path / "live.toml"
    path.write_text("[engine]\ndevice_blocks = 100000\n\n[live]\nnum_layers = 4096\n")
    assert main(["run", "--live", "--config", str(path), "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife: error: {path}:2: field 'engine.device_blocks': 100,000 device blocks of "), err
    assert "x 4096 layers x" in err and err.count("\n") == 1


def test_a_model_that_does_not_fit_names_the_key_that_made_it(tmp_path: Path) -> None:
    assert error_of(tmp_path, "[sim]\nseed = 1\n[engine]\nmax_batched_tokens = 10000000\n").startswith(
        "FILE:4: field 'engine.max_batched_tokens': llama-3-8b does not fit on h100-sxm at tp=1: ")
    assert error_of(tmp_path, "[sim]\ngpu_memory_utilization = 0.1\n").startswith(
        "FILE:2: field 'sim.gpu_memory_utilization': llama-3-8b does not fit on h100-sxm at tp=1: ")


@pytest.mark.parametrize(("flag", "key", "value"), [
    ("--device-blocks", "engine.device_blocks", "0"), ("--device-blocks", "engine.device_blocks", "2.5"),
    ("--ranks", "engine.ranks", "1000000"), ("--seed", "sim.seed", "9223372036854775808"),
    ("--time-scale", "sim.time_scale", "nan"), ("--time-scale", "sim.time_scale", "1e-9"),
    ("--tp", "sim.tp", "0"), ("--seed", "sim.seed", "1.5"),
])
def test_a_flag_refuses_what_its_key_refuses_in_the_same_words(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                flag: str, key: str, value: str) -> None:
    section, _, name = key.partition(".")
    message = error_of(tmp_path, f"[{section}]\n{name} = {value}\n")
    problem = message.split(f"field '{key}': ", 1)[1]
    with pytest.raises(SystemExit) as exited:  # argparse's error, through the flag's type: the key's rule
        main(["run", flag, value])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"kvlife run: error: argument {flag}: {problem}\n"


def test_an_integer_too_long_for_python_is_refused_at_its_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # tomllib reads integers with int(), which refuses more than 4300 digits with a ValueError.
    assert error_of(tmp_path, "# long\n[sim]\nseed = " + "9" * 5000 + "\n") == \
        "FILE:3: field 'sim.seed': an integer of more than 4300 digits"
    with pytest.raises(SystemExit):
        main(["run", "--seed", "9" * 5000])
    assert capsys.readouterr().err == (
        "kvlife run: error: argument --seed: must be at most 9,223,372,036,854,775,807 (the largest integer JSON "
        "traces hold exactly, signed 64-bit), got an integer of about 4999 digits\n")


@pytest.mark.parametrize("word", ["¹", "²³", "①", "+⁵"])
def test_a_digit_that_is_no_decimal_digit_is_no_integer_as_a_flag_either(capsys: pytest.CaptureFixture[str],
                                                                          word: str) -> None:
    """Unicode calls a superscript or circled digit a digit (``str.isdigit``), but ``int``
    reads none: the flag must refuse it as its config key refuses the same string (found by
    tests/test_fuzz_inputs.py: ``--chaos ¹`` was read as 1)."""
    with pytest.raises(SystemExit) as exited:
        main(["run", "--seed", word])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"kvlife run: error: argument --seed: must be an integer, got {word!r}\n"


# ---- Rule.plain_range: the readers' fast path never accepts what the rule refuses ------------
_RANGED = [rule for rule in (*WORKLOAD_RULES.values(), *SYNTHETIC_RULES.values(), Rule("int"), Rule("number"),
                             Rule("number", low=0.5, high=2.0), Rule("int", low=3, maximum=Limit(7, "seven")))
           if rule.plain_range() is not None]


@settings(max_examples=300, deadline=None)
@given(rule=st.sampled_from(_RANGED),
       value=st.one_of(st.integers(), st.integers(min_value=-(2**66), max_value=2**66),
                       st.floats(), st.booleans(), st.none(), st.text(max_size=3)))
def test_every_value_in_a_plain_range_is_one_the_rule_accepts(rule: Rule, value: object) -> None:
    plain = rule.plain_range()
    assert plain is not None
    types, low, high = plain
    if type(value) in types and low <= value <= high:  # type: ignore[operator]
        assert rule.problem(value) is None


@pytest.mark.parametrize("rule", _RANGED)
def test_a_plain_range_reaches_the_rules_own_bounds(rule: Rule) -> None:
    """Tight, not only safe: each finite end is a value the rule accepts, and one past it
    (for an integer rule) is refused."""
    types, low, high = rule.plain_range()  # type: ignore[misc]
    for end, past in ((low, low - 1), (high, high + 1)):
        if not math.isfinite(end):
            continue
        value = int(end) if types == (int,) else end
        assert rule.problem(value) is None
        if types == (int,):
            assert rule.problem(int(past)) is not None


def test_a_rule_with_no_closed_range_has_no_plain_range() -> None:
    assert all(rule.plain_range() is not None for rule in WORKLOAD_RULES.values())  # (the reader needs them)
    assert SYNTHETIC_RULES["arrival_rate_per_s"].plain_range() == ((int, float), 1e-6, 1e9)  # (closed by its minimum)
    assert Rule("number", low=0.0, low_open=True).plain_range() is None
    assert Rule("text").plain_range() is None
    assert Rule("bool").plain_range() is None
