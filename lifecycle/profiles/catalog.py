"""Hardware and model profiles: frozen records loaded from TOML files.

The bundled profiles live in ``data/hardware/*.toml`` and ``data/models/*.toml`` beside this
module, each figure with its public source in a comment. ``load_hardware`` and ``load_model``
take a bundled name (``"h100-sxm"``) or the path of a user's own file (anything with a ``/`` or
ending ``.toml``). A bad file is a ``ProfileError`` whose message is one line naming the file,
the line and the dotted field, in the style of ``kvlife.lifecycle.config.ConfigError``::

    my-gpu.toml:7: field 'nvme.read_gb_s': must be a finite positive number, got -1

Unknown keys, missing keys, wrong types, negative or non-finite numbers are all refused.
Units: FLOP/s, bytes, GB/s = 1e9 bytes per second (per direction for links), ms, us.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

# Bytes per element of the dtypes a profile may name (weights and KV cache share it).
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class ProfileError(ValueError):
    """A bad profile or measurement file. ``str()`` is one line: ``FILE:LINE: field 'x.y': message``."""

    def __init__(self, field: str, message: str, path: str | None = None, line: int | None = None) -> None:
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(f"{where}field '{field}': {message}")
        self.field = field
        self.message = message
        self.path = path
        self.line = line


# --- value checks (shared by the loader and the attrs validators) ---------------------------

Check = Callable[[Any], str | None]  # None when fine, else the complaint


def _is_number(value: Any) -> bool:
    """A finite number (an integer past a float's range is none: math.isfinite would overflow)."""
    from kvlife.lifecycle.config import FLOAT_MAX_INT

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= FLOAT_MAX_INT if isinstance(value, int) else math.isfinite(value)


def _shown(value: Any) -> str:
    from kvlife.lifecycle.config import describe

    return describe(value)


def _positive(value: Any) -> str | None:
    if not _is_number(value) or value <= 0:
        return f"must be a finite positive number, got {_shown(value)}"
    return None


def _non_negative(value: Any) -> str | None:
    if not _is_number(value) or value < 0:
        return f"must be a finite non-negative number, got {_shown(value)}"
    return None


def _fraction(value: Any) -> str | None:
    if not _is_number(value) or not 0 < value <= 1:
        return f"must be a number in (0, 1], got {_shown(value)}"
    return None


def _positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"must be a positive integer, got {_shown(value)}"
    return None


def _text(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f"must be a non-empty string, got {value!r}"
    return None


def _flag(value: Any) -> str | None:
    if not isinstance(value, bool):
        return f"must be true or false, got {value!r}"
    return None


def _within(check: Check, low: float, high: float, why: str) -> Check:
    """``check``, and the value from ``low`` to ``high`` (``why`` says where the bounds come from):
    a profile is data, and a figure of 2^63 GB/s only overflows the step cost downstream."""

    def bounded(value: Any) -> str | None:
        problem = check(value)
        if problem is None and not low <= value <= high:
            return f"must be from {low:g} to {high:g} ({why}), got {_shown(value)}"
        return problem

    return bounded


# Bounds of a profile's figures, far outside any real GPU, link or model (each names its reason).
_GB_S = _within(_positive, 1e-6, 1e6, "GB/s: 1 kB/s to 1 PB/s, over 500x NVLink 5's 1.8 TB/s per GPU")
_FLOPS = _within(_positive, 1e9, 1e18, "FLOP/s: 1e18 is 400x a B200's dense bf16 peak")
_BYTES = _within(_positive_int, 1 << 20, 1 << 50, "bytes: 1 MiB to 1 PiB of device memory")
_LATENCY = _within(_non_negative, 0, 1e9, "11.6 days in ms, or 1e9 us: no latency is longer")
_DIMENSION = _within(_positive_int, 1, 1 << 24, "2^24: far above any released model's width or vocabulary")
_LAYERS = _within(_positive_int, 1, 1 << 16, "2^16 layers: far above any released model")


def _dtype(value: Any) -> str | None:
    if value not in DTYPE_BYTES:
        return f"must be one of {', '.join(sorted(DTYPE_BYTES))}; got {value!r}"
    return None


def _validator(check: Check) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        problem = check(value)
        if problem is not None:
            raise ProfileError(attribute.name, problem)

    return validate


def _as_float(value: Any) -> float:
    return float(value)


# --- records ----------------------------------------------------------------------------------


@attrs.frozen
class Efficiency:
    """How close a step gets to the hardware's peaks (see ``step_cost``).

    ``mfu`` applies to linear-layer FLOPs, ``attention`` to attention FLOPs, ``mbu`` to bytes
    read from device memory, ``overhead_ms`` is added to every step. The bundled hardware files
    give the sources and derivations of their defaults; ``calibrate`` fits them to measurements.
    """

    mfu: float = attrs.field(default=0.5, converter=_as_float, validator=_validator(_fraction))
    attention: float = attrs.field(default=0.5, converter=_as_float, validator=_validator(_fraction))
    mbu: float = attrs.field(default=0.70, converter=_as_float, validator=_validator(_fraction))
    overhead_ms: float = attrs.field(default=0.65, converter=_as_float, validator=_validator(_non_negative))


@attrs.frozen
class Nvme:
    """The disk tier's drive, as seen from one GPU's host (reads and writes share it)."""

    read_gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    write_gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    latency_ms: float = attrs.field(converter=_as_float, validator=_validator(_non_negative))


@attrs.frozen
class Network:
    """The remote tier's NIC, per GPU and per direction (full duplex)."""

    gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    latency_ms: float = attrs.field(converter=_as_float, validator=_validator(_non_negative))


@attrs.frozen
class Hardware:
    """One GPU (and what hangs off its host) as the simulator sees it."""

    name: str = attrs.field(validator=_validator(_text))
    description: str = attrs.field(validator=_validator(_text))
    peak_bf16_flops: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    hbm_bytes: int = attrs.field(validator=_validator(_positive_int))
    hbm_bandwidth_gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    host_link: str = attrs.field(validator=_validator(_text))
    host_link_gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    interconnect: str = attrs.field(validator=_validator(_text))
    interconnect_gb_s: float = attrs.field(converter=_as_float, validator=_validator(_positive))
    allreduce_latency_us: float = attrs.field(converter=_as_float, validator=_validator(_non_negative))
    nvme: Nvme
    network: Network
    efficiency: Efficiency = Efficiency()
    # Where the profile was read from (None for one built in code); not part of equality.
    source: str | None = attrs.field(default=None, eq=False)

    def with_efficiency(self, efficiency: Efficiency) -> Hardware:
        """The same hardware with other efficiency factors (e.g. fitted by ``calibrate``)."""
        return attrs.evolve(self, efficiency=efficiency)


@attrs.frozen
class Model:
    """A dense decoder-only transformer (Llama / Mistral / Qwen2 shape: GQA attention, SwiGLU MLP)."""

    name: str = attrs.field(validator=_validator(_text))
    hf_id: str = attrs.field(validator=_validator(_text))
    num_layers: int = attrs.field(validator=_validator(_positive_int))
    hidden_size: int = attrs.field(validator=_validator(_positive_int))
    num_attention_heads: int = attrs.field(validator=_validator(_positive_int))
    num_kv_heads: int = attrs.field(validator=_validator(_positive_int))
    head_dim: int = attrs.field(validator=_validator(_positive_int))
    intermediate_size: int = attrs.field(validator=_validator(_positive_int))
    vocab_size: int = attrs.field(validator=_validator(_positive_int))
    dtype: str = attrs.field(validator=_validator(_dtype))
    tie_word_embeddings: bool = attrs.field(default=False, validator=_validator(_flag))
    attention_bias: bool = attrs.field(default=False, validator=_validator(_flag))
    source: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise ProfileError(
                "num_kv_heads",
                f"must divide num_attention_heads ({self.num_attention_heads}), got {self.num_kv_heads}",
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# --- schemas: section -> key -> check; "" is the top level ------------------------------------

_HARDWARE_SCHEMA: dict[str, dict[str, Check]] = {
    "": {
        "name": _text,
        "description": _text,
        "peak_bf16_flops": _FLOPS,
        "hbm_bytes": _BYTES,
        "hbm_bandwidth_gb_s": _GB_S,
        "host_link": _text,
        "host_link_gb_s": _GB_S,
        "interconnect": _text,
        "interconnect_gb_s": _GB_S,
        "allreduce_latency_us": _LATENCY,
    },
    "nvme": {"read_gb_s": _GB_S, "write_gb_s": _GB_S, "latency_ms": _LATENCY},
    "network": {"gb_s": _GB_S, "latency_ms": _LATENCY},
    "efficiency": {"mfu": _fraction, "attention": _fraction, "mbu": _fraction, "overhead_ms": _LATENCY},
}

_MODEL_SCHEMA: dict[str, dict[str, Check]] = {
    "": {
        "name": _text,
        "hf_id": _text,
        "num_layers": _LAYERS,
        "hidden_size": _DIMENSION,
        "num_attention_heads": _DIMENSION,
        "num_kv_heads": _DIMENSION,
        "head_dim": _DIMENSION,
        "intermediate_size": _DIMENSION,
        "vocab_size": _DIMENSION,
        "dtype": _dtype,
        "tie_word_embeddings": _flag,
        "attention_bias": _flag,
    },
}
_MODEL_OPTIONAL = {"tie_word_embeddings", "attention_bias"}
_CALIBRATION_OPTIONAL = {f"calibration.{key}" for key in ("source", "model", "hardware", "tp", "rows",
                                                          "rms_relative_error", "max_relative_error")}

# An efficiency file (what ``calibrate`` writes): [efficiency] plus an optional [calibration]
# table describing the fit, which is read back but not interpreted.
_EFFICIENCY_SCHEMA: dict[str, dict[str, Check]] = {
    "efficiency": _HARDWARE_SCHEMA["efficiency"],
    "calibration": {
        "source": _text,
        "model": _text,
        "hardware": _text,
        "tp": _positive_int,
        "rows": _positive_int,
        "rms_relative_error": _non_negative,
        "max_relative_error": _non_negative,
    },
}


# --- loading ----------------------------------------------------------------------------------


def _data_dir(kind: str) -> Path:
    """The bundled profiles of one kind (files beside this module: importlib.resources
    would cost every run ~4 ms of imports for a package that never ships zipped)."""
    return Path(__file__).parent / "data" / kind


def list_profiles() -> dict[str, list[str]]:
    """The bundled profile names: ``{"hardware": [...], "models": [...]}``, sorted."""
    out: dict[str, list[str]] = {}
    for kind in ("hardware", "models"):
        out[kind] = sorted(p.name[: -len(".toml")] for p in _data_dir(kind).iterdir() if p.name.endswith(".toml"))
    return out


def _read(kind: str, name_or_path: str | Path, what: str) -> tuple[str, str]:
    """(display path, text) of a bundled profile name or a file path."""
    text_name = str(name_or_path)
    is_path = isinstance(name_or_path, Path) or "/" in text_name or text_name.endswith(".toml")
    if is_path:
        from kvlife.lifecycle.input_files import read_limited

        path = Path(name_or_path)
        # A file that cannot be read is the fault of whatever named it (a flag, a config key):
        # the error names the key (``what``), and the caller says where it was set.
        try:
            return str(path), read_limited(path).decode("utf-8")
        except OSError as exc:
            raise ProfileError(what, f"cannot read {what} profile {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ProfileError(what, f"cannot read {what} profile {str(path)!r}: not UTF-8 text (byte "
                                     f"{exc.start})") from None
    known = list_profiles()[kind]
    if text_name not in known:
        raise ProfileError(what, f"unknown {what} profile {text_name!r} (known: {', '.join(known)}; or give a path)")
    resource = _data_dir(kind) / f"{text_name}.toml"
    return f"{what}/{text_name}.toml", resource.read_text()


def toml_error_line(exc: tomllib.TOMLDecodeError) -> int | None:
    """The line a TOML error points at (``lineno`` from Python 3.14, else parsed from the message)."""
    line = getattr(exc, "lineno", None)
    if isinstance(line, int):
        return line
    found = re.search(r"at line (\d+)", str(exc))
    return int(found.group(1)) if found else None


def _line_of(text: str, section: str, key: str) -> int | None:
    """The line where ``key`` is set inside ``[section]`` ("" = top level), or the section's
    header line when ``key`` is empty."""
    current = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("[") and not line.startswith("[["):
            current = line.strip("[] \t").split("#")[0].strip()
            if not key and current == section:
                return number
            continue
        if current == section and key and line.startswith(key):
            rest = line[len(key):].lstrip()
            if rest.startswith("="):
                return number
    return None


def _parse(path: str, text: str, schema: Mapping[str, Mapping[str, Check]], optional: set[str]) -> dict[str, Any]:
    """Check ``text`` against ``schema``; return {section: {key: value}} (top level under "")."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError("-", f"not valid TOML: {exc}", path, toml_error_line(exc)) from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise ProfileError("-", "not valid TOML: nested too deeply", path) from None
    except ValueError:  # tomllib's int() of an integer of more than 4300 digits
        from kvlife.lifecycle.config import huge_integer_line

        line = huge_integer_line(text)
        key = text.splitlines()[line - 1].partition("=")[0].strip() if line else "-"
        raise ProfileError(key, "an integer of more than 4300 digits", path, line) from None

    def fail(section: str, key: str, message: str) -> ProfileError:
        dotted = f"{section}.{key}" if section and key else (section or key)
        return ProfileError(dotted, message, path, _line_of(text, section, key) or _line_of(text, section, ""))

    out: dict[str, dict[str, Any]] = {section: {} for section in schema}
    top = schema.get("", {})
    for key, value in data.items():
        if isinstance(value, dict) and key in schema and key != "":
            continue
        if key not in top:
            known = sorted([*top, *(f"[{s}]" for s in schema if s)])
            raise fail("", key, f"unknown key (known: {', '.join(known)})")
    for section, checks in schema.items():
        values = data if section == "" else data.get(section)
        if values is None:
            if section and section in _OPTIONAL_SECTIONS:
                continue
            raise fail("", section, "missing section")
        if not isinstance(values, dict):
            raise fail("", section, "must be a table")
        if section:
            for key in values:
                if key not in checks:
                    raise fail(section, key, f"unknown key (known: {', '.join(sorted(checks))})")
        for key, check in checks.items():
            if key not in values:
                if (f"{section}.{key}" if section else key) in optional:
                    continue
                raise ProfileError(
                    f"{section}.{key}" if section else key, "missing", path,
                    _line_of(text, section, "") if section else None,
                )
            problem = check(values[key])
            if problem is not None:
                raise fail(section, key, problem)
            out[section][key] = values[key]
    return out


# Sections a file may leave out (their records then take their defaults).
_OPTIONAL_SECTIONS = {"efficiency", "calibration"}


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A bundled hardware profile by name (``list_profiles()["hardware"]``) or a TOML file."""
    path, text = _read("hardware", name_or_path, "hardware")
    values = _parse(path, text, _HARDWARE_SCHEMA, set())
    efficiency = Efficiency(**values["efficiency"]) if values["efficiency"] else Efficiency()
    return Hardware(
        **values[""], nvme=Nvme(**values["nvme"]), network=Network(**values["network"]),
        efficiency=efficiency, source=path,
    )


def load_model(name_or_path: str | Path) -> Model:
    """A bundled model profile by name (``list_profiles()["models"]``) or a TOML file."""
    path, text = _read("models", name_or_path, "model")
    values = _parse(path, text, _MODEL_SCHEMA, _MODEL_OPTIONAL)
    try:
        return Model(**values[""], source=path)
    except ProfileError as exc:
        raise ProfileError(exc.field, exc.message, path, _line_of(text, "", exc.field)) from None


def load_efficiency(path: str | Path) -> Efficiency:
    """The ``[efficiency]`` table of a file ``calibrate`` wrote (or any hardware profile)."""
    display, text = _read("hardware", Path(path), "efficiency")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError("-", f"not valid TOML: {exc}", display, toml_error_line(exc)) from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise ProfileError("-", "not valid TOML: nested too deeply", display) from None
    except ValueError:  # tomllib's int() of an integer of more than 4300 digits
        from kvlife.lifecycle.config import huge_integer_line

        line = huge_integer_line(text)
        key = text.splitlines()[line - 1].partition("=")[0].strip() if line else "-"
        raise ProfileError(key, "an integer of more than 4300 digits", display, line) from None
    schema = _HARDWARE_SCHEMA if "peak_bf16_flops" in data else _EFFICIENCY_SCHEMA
    values = _parse(display, text, schema, _CALIBRATION_OPTIONAL)
    if not values["efficiency"]:
        raise ProfileError("efficiency", "missing section", display)
    return Efficiency(**values["efficiency"])
