"""Fit the step-cost efficiency factors (mfu, attention, mbu, overhead_ms) to measured steps.

Input: a CSV of measured step timings with the header
``prefill_tokens,decode_requests,context_tokens,step_ms`` (any order; ``#`` lines are comments).
A row is one step: one prefill chunk of ``prefill_tokens`` new tokens on top of
``context_tokens`` cached tokens (none when 0), plus ``decode_requests`` decodes each with
``context_tokens`` tokens of context (``step_cost.composition_of_row``). ``profile_gpu`` writes
such files. Bad input is a one-line ``ProfileError``: ``FILE:LINE: field 'step_ms': ...``.

The fit minimises the squared *relative* error of the predicted step times (step times span
milliseconds to seconds). The model is piecewise linear in ``(1/mfu, 1/attention, 1/mbu,
overhead)`` (``step_cost``: two ``max`` terms), so we alternate: label each row's phases
compute- or memory-bound with the current factors, solve the weighted linear least squares in
closed form (4x4 normal equations, bounds by active set: efficiencies <= 1, overhead >= 0),
relabel, repeat; then refine each factor by golden-section search on the true objective.
Plain Python, deterministic. A factor the data cannot see (no row where its term is >= 2 % of
the step and within 2x of the term it competes with) keeps its starting value and is reported
in ``FitResult.fixed``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from kvlife.lifecycle.profiles.catalog import Efficiency, Hardware, Model, ProfileError
from kvlife.lifecycle.profiles.step_cost import StepCostModel, composition_of_row

COLUMNS = ("prefill_tokens", "decode_requests", "context_tokens", "step_ms")
PARAMETERS = ("mfu", "attention", "mbu", "overhead_ms")
# A factor whose term never reaches this share of any measured step is not identifiable.
_VISIBLE = 0.02
# The fit uses at most this many rows (every k-th of a larger file; 4 factors need far fewer):
# each trial of the search evaluates every row (a 200,000-row file took over 90 s).
FIT_ROWS = 5000


@attrs.frozen
class TimingRow:
    line: int
    prefill_tokens: int
    decode_requests: int
    context_tokens: int
    step_ms: float


@attrs.frozen
class FitResult:
    efficiency: Efficiency
    rows: int
    rms_relative_error: float
    max_relative_error: float
    fixed: tuple[str, ...]  # factors the data could not identify (kept at their start values)
    fitted_rows: int = 0  # the rows the fit used: all of them, or every k-th past FIT_ROWS


# What a measured row may hold: a step of at most 2^24 tokens of prefill and of context (the
# longest prompt a config allows, kvlife.lifecycle.config.TOKENS) and as many decodes; a step
# time from a nanosecond (below it, no GPU step; 1/t^2 weights underflow) to 11.6 days.
MAX_COUNT = 1 << 24
MIN_STEP_MS = 1e-6
MAX_STEP_MS = 1e9
# A line of a timing CSV is four numbers: anything past this is no row.
MAX_LINE = 4096


def read_timings(path: str | Path) -> list[TimingRow]:
    """Rows of a timing CSV; ``ProfileError`` naming file, line and column on bad input.
    Read through ``kvlife.lifecycle.input_files`` (a regular file, lines of at most
    ``MAX_LINE`` bytes), as UTF-8."""
    from kvlife.lifecycle.input_files import READ_ERRORS, Lines, error_line, read_error_message

    p = Path(path)
    lines = Lines(p, MAX_LINE, "a row of four numbers is far shorter")
    rows: list[TimingRow] = []
    header: list[str] | None = None
    header_line = 0
    try:
        for number, raw in lines:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProfileError("-", f"not UTF-8 text (byte {exc.start} of the line)", str(p), number) from None
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                cells = [c.strip() for c in next(csv.reader([line]))]
            except csv.Error as exc:
                raise ProfileError("-", f"not a CSV row: {exc}", str(p), number) from None
            if header is None:
                header, header_line = cells, number
                _check_header(header, str(p), header_line)
                continue
            rows.append(_row(header, cells, str(p), number))
    except READ_ERRORS as exc:
        raise ProfileError("-", f"cannot read timings: {read_error_message(exc)}", str(p),
                           error_line(exc, None)) from None
    if header is None:
        raise ProfileError("-", f"no header (expected {','.join(COLUMNS)})", str(p))
    if not rows:
        raise ProfileError("-", "no timing rows", str(p))
    return rows


def _check_header(header: list[str], path: str, line: int) -> None:
    for name in header:
        if name not in COLUMNS:
            raise ProfileError(name, f"unknown column (expected {','.join(COLUMNS)})", path, line)
    for name in COLUMNS:
        if name not in header:
            raise ProfileError(name, "missing column", path, line)
    if len(set(header)) != len(header):
        raise ProfileError("-", "duplicate column in header", path, line)


def _row(header: list[str], cells: list[str], path: str, number: int) -> TimingRow:
    if len(cells) != len(header):
        raise ProfileError("-", f"expected {len(header)} columns, got {len(cells)}", path, number)
    values = dict(zip(header, cells, strict=True))
    counts: dict[str, int] = {}
    for name in COLUMNS[:3]:
        text = values[name]
        digits = text.lstrip("+")
        counts[name] = int(digits) if digits.isascii() and digits.isdecimal() and len(digits) <= 9 else -1
        if not 0 <= counts[name] <= MAX_COUNT:
            raise ProfileError(name, f"must be an integer from 0 to 2^24 (the longest prompt), got {_shown(text)}",
                               path, number)
    try:
        step = float(values["step_ms"]) if values["step_ms"].isascii() else math.nan  # (float() reads "٣" as 3)
    except ValueError:
        step = math.nan
    if not (MIN_STEP_MS <= step <= MAX_STEP_MS):  # (NaN fails both)
        raise ProfileError("step_ms", f"must be a number of ms from {MIN_STEP_MS:g} (a nanosecond) to "
                                      f"{MAX_STEP_MS:g} (11.6 days), got {_shown(values['step_ms'])}", path, number)
    if counts["prefill_tokens"] == 0 and counts["decode_requests"] == 0:
        raise ProfileError("prefill_tokens", "a step needs prefill tokens or decode requests", path, number)
    return TimingRow(number, counts["prefill_tokens"], counts["decode_requests"], counts["context_tokens"], step)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


# --- the fit ----------------------------------------------------------------------------------

# Per row, the times at 100 % efficiency (ms): linear compute L, attention compute A, weight
# reads W, KV reads K; plus communication C (not fitted) and the measured time t.
_Terms = tuple[float, float, float, float, float, float]


def _terms(rows: Sequence[TimingRow], cost: StepCostModel, include_comm: bool) -> list[_Terms]:
    peak = cost.hardware.peak_bf16_flops
    bandwidth = cost.hardware.hbm_bandwidth_gb_s * 1e9
    out = []
    for r in rows:
        prefills, decodes = composition_of_row(r.prefill_tokens, r.decode_requests, r.context_tokens)
        f = cost.features(prefills, decodes)
        out.append((
            f.linear_flops / peak * 1000.0,
            f.attention_flops / peak * 1000.0,
            f.weight_bytes / bandwidth * 1000.0,
            f.kv_bytes / bandwidth * 1000.0,
            f.comm_ms if include_comm else 0.0,
            r.step_ms,
        ))
    return out


# theta = (1/mfu, 1/attention, 1/mbu, overhead_ms); lower bounds (1, 1, 1, 0).
_LOWER = (1.0, 1.0, 1.0, 0.0)
_UPPER = (1000.0, 1000.0, 1000.0, math.inf)


def _predict(theta: Sequence[float], t: _Terms) -> float:
    a, b, c, o = theta
    linear, attention, weights, kv, comm, _ = t
    return max(a * linear, c * weights) + max(b * attention, c * kv) + comm + o


def _objective(theta: Sequence[float], terms: Sequence[_Terms]) -> float:
    """The sum of squared relative errors: ``_predict`` inlined (it runs once per row per
    trial of the search)."""
    a, b, c, o = theta
    total = 0.0
    for linear, attention, weights, kv, comm, t in terms:
        compute, memory = a * linear, c * weights
        first = compute if compute >= memory else memory
        compute, memory = b * attention, c * kv
        second = compute if compute >= memory else memory
        error = (first + second + comm + o - t) / t
        total += error * error
    return total


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= factor * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _least_squares(
    theta: list[float], terms: Sequence[_Terms], free: Sequence[int]
) -> list[float]:
    """One relabel-and-solve pass: the bound-constrained weighted least squares for the current
    compute/memory labels of each row."""
    a, b, c, o = theta
    design: list[tuple[list[float], float, float]] = []  # (row of coefficients, target, weight)
    for linear, attention, weights, kv, comm, t in terms:
        lin_compute = a * linear >= c * weights
        att_compute = b * attention >= c * kv
        coefficients = [
            linear if lin_compute else 0.0,
            attention if att_compute else 0.0,
            (0.0 if lin_compute else weights) + (0.0 if att_compute else kv),
            1.0,
        ]
        design.append((coefficients, t - comm, 1.0 / (t * t)))
    fixed_at: dict[int, float] = {j: theta[j] for j in range(4) if j not in free}
    for _ in range(5):  # active set: pin a violated bound, solve again
        active = [j for j in range(4) if j not in fixed_at]
        if not active:
            break
        normal = [[0.0] * len(active) for _ in active]
        rhs = [0.0] * len(active)
        for coefficients, target, weight in design:
            residual_target = target - sum(coefficients[j] * v for j, v in fixed_at.items())
            for i, ji in enumerate(active):
                rhs[i] += weight * coefficients[ji] * residual_target
                for k, jk in enumerate(active):
                    normal[i][k] += weight * coefficients[ji] * coefficients[jk]
        solution = _solve(normal, rhs)
        if solution is None:
            return theta
        out = dict(fixed_at)
        out.update(zip(active, solution, strict=True))
        violated = [j for j in active if not _LOWER[j] <= out[j] <= _UPPER[j]]
        if not violated:
            return [out[j] for j in range(4)]
        for j in violated:
            fixed_at[j] = min(max(out[j], _LOWER[j]), _UPPER[j])
    return [min(max(fixed_at.get(j, theta[j]), _LOWER[j]), _UPPER[j]) for j in range(4)]


def _golden(fn: Callable[[float], float], lo: float, hi: float, steps: int = 60) -> float:
    invphi = (math.sqrt(5.0) - 1.0) / 2.0
    x1 = hi - invphi * (hi - lo)
    x2 = lo + invphi * (hi - lo)
    f1 = fn(x1)
    f2 = fn(x2)
    for _ in range(steps):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - invphi * (hi - lo)
            f1 = fn(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + invphi * (hi - lo)
            f2 = fn(x2)
    return (lo + hi) / 2.0


def _refine(theta: list[float], terms: Sequence[_Terms], free: Sequence[int]) -> list[float]:
    """Coordinate-wise golden-section search on the true objective, each factor within a
    factor of 2 of its current value (bounds respected)."""
    best = list(theta)
    best_value = _objective(best, terms)
    for _ in range(4):
        for j in free:
            current = best[j]
            lo = max(_LOWER[j], current / 2.0 if j < 3 else 0.0)
            hi = min(_UPPER[j], current * 2.0 if j < 3 else max(2.0 * current, 1.0))

            def at(v: float, j: int = j) -> float:
                trial = list(best)
                trial[j] = v
                return _objective(trial, terms)

            candidate = _golden(at, lo, hi)
            value = at(candidate)
            if value < best_value:
                best[j] = candidate
                best_value = value
    return best


def fit_efficiency(
    rows: Sequence[TimingRow],
    model: Model,
    hardware: Hardware,
    tp: int = 1,
    start: Efficiency | None = None,
    include_comm: bool = True,
) -> FitResult:
    """Fit ``Efficiency`` to measured rows. ``include_comm=False`` when the measurements hold no
    all-reduce time (``profile_gpu`` times one rank's shard on one GPU)."""
    if not rows:
        raise ProfileError("-", "no timing rows to fit")
    cost = StepCostModel(model, hardware, tp)
    all_terms = _terms(rows, cost, include_comm)
    # More rows than FIT_ROWS: fit on every k-th (deterministic), judge the fit on all.
    stride = -(-len(all_terms) // FIT_ROWS)
    terms = all_terms[::stride]
    initial = start if start is not None else hardware.efficiency
    theta0 = [1.0 / initial.mfu, 1.0 / initial.attention, 1.0 / initial.mbu, initial.overhead_ms]
    # Which factors can the data see? A term must reach _VISIBLE of some row's time while within
    # a factor of 2 of the term it competes with in its phase's max (else no plausible change of
    # the factor moves a prediction).
    a0, b0, c0, _ = theta0

    def shows(term: float, rival: float, t: float) -> bool:
        return term >= _VISIBLE * t and term >= 0.5 * rival

    visible = [
        any(shows(a0 * t[0], c0 * t[2], t[5]) for t in terms),
        any(shows(b0 * t[1], c0 * t[3], t[5]) for t in terms),
        any(shows(c0 * t[2], a0 * t[0], t[5]) or shows(c0 * t[3], b0 * t[1], t[5]) for t in terms),
        len(terms) >= 2,
    ]
    free = [j for j in range(4) if visible[j]]
    best = list(theta0)
    best_value = _objective(best, terms)
    # Start from the given factors, and from all-compute / all-memory labels.
    for seed in (list(theta0), [1.0, 1.0, theta0[2] * 4, theta0[3]], [theta0[0] * 4, theta0[1] * 4, 1.0, theta0[3]]):
        theta = [seed[j] if j in free else theta0[j] for j in range(4)]
        seen: set[tuple[float, ...]] = set()
        for _ in range(50):
            theta = _least_squares(theta, terms, free)
            key = tuple(round(v, 12) for v in theta)
            if key in seen:
                break
            seen.add(key)
        value = _objective(theta, terms)
        if value < best_value:
            best, best_value = theta, value
    best = _refine(best, terms, free)
    errors = [abs(_predict(best, t) - t[5]) / t[5] for t in all_terms]
    efficiency = Efficiency(mfu=1.0 / best[0], attention=1.0 / best[1], mbu=1.0 / best[2], overhead_ms=best[3])
    return FitResult(
        efficiency=efficiency,
        rows=len(rows),
        rms_relative_error=math.sqrt(sum(e * e for e in errors) / len(errors)),
        max_relative_error=max(errors),
        fixed=tuple(PARAMETERS[j] for j in range(4) if j not in free),
        fitted_rows=len(terms),
    )


def efficiency_toml(result: FitResult, model: Model, hardware: Hardware, tp: int, source: str) -> str:
    """The profile file ``calibrate`` writes: an ``[efficiency]`` table (``load_efficiency``
    reads it; ``Hardware.with_efficiency`` applies it) and a ``[calibration]`` record."""
    e = result.efficiency
    lines = [
        f"# kvlife calibrate: step-cost efficiency fitted to {result.rows} measured steps of {model.name}",
        f"# on {hardware.name} (tp={tp}). Relative error of the fit: rms {result.rms_relative_error:.1%}, "
        f"max {result.max_relative_error:.1%}.",
    ]
    if result.fixed:
        lines.append(f"# Not identifiable from these rows (kept at their starting values): {', '.join(result.fixed)}.")
    lines += [
        "[efficiency]",
        f"mfu = {min(e.mfu, 1.0):.4f}",
        f"attention = {min(e.attention, 1.0):.4f}",
        f"mbu = {min(e.mbu, 1.0):.4f}",
        f"overhead_ms = {e.overhead_ms:.4f}",
        "",
        "[calibration]",
        f"source = {json.dumps(source)}",
        f"model = {json.dumps(model.name)}",
        f"hardware = {json.dumps(hardware.name)}",
        f"tp = {tp}",
        f"rows = {result.rows}",
        f"rms_relative_error = {result.rms_relative_error:.6f}",
        f"max_relative_error = {result.max_relative_error:.6f}",
        "",
    ]
    return "\n".join(lines)


def calibrate(
    csv_path: str | Path,
    model: Model,
    hardware: Hardware,
    tp: int = 1,
    out: str | Path | None = None,
    include_comm: bool = True,
) -> FitResult:
    """Read ``csv_path``, fit, and (when ``out`` is given) write the efficiency profile there."""
    rows = read_timings(csv_path)
    result = fit_efficiency(rows, model, hardware, tp, include_comm=include_comm)
    if out is not None:
        from kvlife.lifecycle.output_files import write_output

        write_output(out, efficiency_toml(result, model, hardware, tp, str(csv_path)).encode(), inputs=(csv_path,))
    return result
