"""Step times the model predicts, next to published measurements of the same steps.

Each measurement names the (model, hardware, tensor-parallel) pair, the step's composition,
the measured time, where it was published, and which efficiency factor it was used to set,
if any: a figure that set a factor checks consistency, not prediction, and the table says so.
Predictions come from ``StepCostModel`` directly, with the profiles' default efficiencies.

Lambda's vLLM benchmark (vLLM v0.6, ``github.com/LambdaLabsML/vllm-benchmark``, files under
``results/prompt_10/``) sends the same 10 prompts (1,369 input tokens:
``LAMBDA_PROMPTS``) at once. All ten are prefilled in one step, so the median TTFT is that
step (plus the HTTP front end, which a client-side TTFT includes: about 20 ms, see
``h100-sxm.toml``); with multi-step scheduling a streamed chunk carries 10 decode steps, so
the median inter-token latency over 10 is one decode step of (at most) those ten requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvlife.lifecycle.fidelity import markdown as md
from kvlife.lifecycle.profiles import load_hardware, load_model
from kvlife.lifecycle.profiles.step_cost import StepCostModel

# The input lengths of Lambda's ten prompts ("input_lens" in every results/prompt_10 file).
LAMBDA_PROMPTS = (13, 25, 27, 10, 329, 29, 399, 328, 4, 205)
LAMBDA = "Lambda vllm-benchmark, results/prompt_10/"


def decode_of_prompts(model: StepCostModel) -> float:
    """One decode step of the ten prompts, each with its prompt as context."""
    return model.step_ms((), list(LAMBDA_PROMPTS))


def prefill_of_prompts(model: StepCostModel) -> float:
    """The ten prompts prefilled together in one step."""
    return model.step_ms([(n, 0) for n in LAMBDA_PROMPTS])


def long_prefill(tokens: int) -> Callable[[StepCostModel], float]:
    def predict(model: StepCostModel) -> float:
        return model.prefill_ms(tokens, chunk_tokens=8192)

    return predict


@attrs.frozen
class Measurement:
    model: str  # profile names
    hardware: str
    tp: int
    step: str
    measured_ms: float
    source: str
    used_for: str  # the efficiency factor it set, "-" if none: then it is an independent check
    predict: Callable[[StepCostModel], float]
    note: str = ""


def _lambda(path: str, what: str) -> str:
    return f"{LAMBDA}{path}, median {what}"


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("llama-3-8b", "h100-sxm", 1, "decode, the 10 prompts", 7.23,
                _lambda("1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json", "ITL 72.30 ms / 10 steps"),
                "mbu, overhead_ms (fit)", decode_of_prompts),
    Measurement("llama-3-8b", "h100-sxm", 1, "prefill, the 10 prompts in one step", 62.19,
                _lambda("1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json", "TTFT"),
                "mfu (informed)", prefill_of_prompts, "client TTFT: includes the HTTP front end"),
    Measurement("llama-3-70b", "h100-sxm", 4, "decode, the 10 prompts", 17.50,
                _lambda("4xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp4_len2048.json", "ITL 174.99 ms / 10 steps"),
                "allreduce_latency_us (fit)", decode_of_prompts),
    Measurement("llama-3-70b", "h100-sxm", 4, "prefill, the 10 prompts in one step", 140.56,
                _lambda("4xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp4_len2048.json", "TTFT"),
                "mfu (informed)", prefill_of_prompts, "client TTFT: includes the HTTP front end"),
    Measurement("llama-3-8b", "h100-sxm", 4, "decode, the 10 prompts", 3.725,
                _lambda("4xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp4_len2048.json", "ITL 37.25 ms / 10 steps"),
                "-", decode_of_prompts),
    Measurement("llama-3-8b", "h100-sxm", 4, "prefill, the 10 prompts in one step", 47.92,
                _lambda("4xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp4_len2048.json", "TTFT"),
                "-", prefill_of_prompts, "client TTFT: includes the HTTP front end"),
    Measurement("llama-3-8b", "a100-80gb", 1, "decode, the 10 prompts", 11.485,
                _lambda("1xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json", "ITL 114.85 ms / 10 steps"),
                "-", decode_of_prompts),
    Measurement("llama-3-8b", "a100-80gb", 1, "prefill, the 10 prompts in one step", 126.73,
                _lambda("1xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json", "TTFT"),
                "-", prefill_of_prompts, "client TTFT: includes the HTTP front end"),
    Measurement("llama-3-8b", "a100-80gb", 1, "prefill of 300K tokens (8,192-token chunks)", 180_000.0,
                "MInference (arXiv 2407.02490) Fig. 1b, corrected in github.com/microsoft/MInference/issues/84",
                "attention (informed)", long_prefill(300_000), "dense attention, Llama-3-8B-262K"),
    Measurement("llama-3-8b", "a100-80gb", 1, "prefill of 1M tokens (8,192-token chunks)", 1_800_000.0,
                "MInference (arXiv 2407.02490) Fig. 1b, corrected in github.com/microsoft/MInference/issues/84",
                "attention (informed)", long_prefill(1_000_000), "dense attention, Llama-3-8B-262K"),
)


@attrs.frozen
class StepRow:
    measurement: Measurement
    predicted_ms: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measurement.measured_ms - 1.0


@attrs.frozen
class StepTimeSection:
    rows: tuple[StepRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [{
            "model": r.measurement.model, "hardware": r.measurement.hardware, "tp": r.measurement.tp,
            "step": r.measurement.step, "predicted_ms": r.predicted_ms, "measured_ms": r.measurement.measured_ms,
            "relative_error": r.error, "source": r.measurement.source, "used_for": r.measurement.used_for,
            "note": r.measurement.note,
        } for r in self.rows]}

    def render(self) -> str:
        table = md.table(
            ["pair", "step", "model", "measured", "error", "factor it set", "source"],
            [[f"{r.measurement.model}, {r.measurement.hardware}, TP{r.measurement.tp}", r.measurement.step,
              md.seconds_or_ms(r.predicted_ms), md.seconds_or_ms(r.measurement.measured_ms)
              + (f" ({r.measurement.note})" if r.measurement.note else ""),
              md.signed_percent(r.error, 0), r.measurement.used_for, r.measurement.source] for r in self.rows],
            align="llrrrll",
        )
        independent = [r for r in self.rows if r.measurement.used_for == "-"]
        worst = max(independent, key=lambda r: abs(r.error)) if independent else None
        lines = [table, ""]
        if worst is not None:
            lines.append(
                f"- Independent checks (no factor set from them): {len(independent)} rows, errors from "
                f"{md.signed_percent(min(r.error for r in independent), 0)} to "
                f"{md.signed_percent(max(r.error for r in independent), 0)}; the largest is "
                f"{worst.measurement.model} {worst.measurement.hardware} TP{worst.measurement.tp}, "
                f"{worst.measurement.step}.")
        lines.append("- A client-side TTFT includes the serving front end (HTTP, tokenization, about 20 ms on "
                     "these runs); the model predicts the engine step alone, so it is expected to be lower there.")
        return "\n".join(lines)


def step_time_section() -> StepTimeSection:
    models: dict[tuple[str, str, int], StepCostModel] = {}
    rows = []
    for m in MEASUREMENTS:
        key = (m.model, m.hardware, m.tp)
        if key not in models:
            models[key] = StepCostModel(load_model(m.model), load_hardware(m.hardware), m.tp)
        rows.append(StepRow(m, m.predict(models[key])))
    return StepTimeSection(tuple(rows))
