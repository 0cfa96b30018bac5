"""The fidelity report: what each mode runs, the sections it produces, and the document it writes.

``build_report(FULL)`` runs everything ``docs/fidelity.md`` shows (a few minutes on two
cores); ``QUICK`` runs the same sections on small slices (seconds: tests and CI; its numbers are
not the published ones). ``write_report`` rewrites only the generated blocks of the document
(``markdown.replace_blocks``), creating it from ``TEMPLATE`` when it does not exist yet. The
report holds no wall time, date or version, so the same code writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.fidelity import markdown as md
from kvlife.lifecycle.fidelity.hit_ratio import HitRatioSection, hit_ratio_section
from kvlife.lifecycle.fidelity.policy_effects import GroupResult, policy_effects
from kvlife.lifecycle.fidelity.step_time import StepTimeSection, step_time_section


@attrs.frozen
class Plan:
    name: str
    hit_requests: int | None  # None: the whole conversation trace
    capacities_tokens: tuple[int, ...]  # host tiers of the hit-ratio table (infinite is added)
    slices: tuple[tuple[str, int], ...]  # workload -> requests, for the policy effects
    max_search_runs: int  # operating-point search, per group

    def slice_of(self) -> Mapping[str, int]:
        return dict(self.slices)


FULL = Plan("full", None, (3_000_000, 10_000_000, 50_000_000),
            (("mooncake-conversation", 2000), ("synthetic:burst", 1000), ("synthetic", 1000)), 6)
QUICK = Plan("quick", 600, (1_000_000, 2_000_000, 4_000_000),
             (("mooncake-conversation", 150), ("synthetic:burst", 150), ("synthetic", 120)), 3)

SECTIONS = ("setup", "hit-ratio", "step-time", "policy-effects")


def _profile_keys(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Config entries naming the hardware, model or TP degree, wherever the config keeps them."""
    found: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in ("hardware", "model", "tp") and isinstance(item, str | int):
                found.append((where, item))
            else:
                found += _profile_keys(item, where)
    return found


@attrs.frozen
class Report:
    plan: Plan
    config: RunConfig
    hit_ratio: HitRatioSection
    step_time: StepTimeSection
    effects: tuple[GroupResult, ...]

    def setup(self) -> str:
        engine = self.config.engine
        tiers = ", ".join(f"{t.name} {t.capacity_blocks:,} blocks" for t in engine.tiers) or "none"
        profile = ", ".join(f"`{k}` = {v}" for k, v in _profile_keys(self.config.to_dict()))
        device = self.hit_ratio.infinite.engine.device_blocks
        mode = ("**Quick mode** (`--quick`): small slices, for tests and CI; these are not the published figures."
                if self.plan.name == "quick" else
                "Full mode: the figures this page publishes (`kvlife fidelity` from the repository root).")
        lines = [
            mode,
            "",
            f"Simulator config: the defaults of `kvlife run`, changed only where a table says so: "
            f"{engine.block_tokens}-token blocks, device "
            f"{f'{device:,} blocks' if device is not None else 'as the default profile derives it'}, "
            f"token budget {engine.max_batched_tokens:,} per step, tiers: {tiers}; seed {self.config.sim.seed}."
            + (f" Profile: {profile}." if profile else ""),
        ]
        return "\n".join(lines)

    def blocks(self) -> dict[str, str]:
        effects = "\n\n".join(g.render() for g in self.effects)
        return {"setup": self.setup(), "hit-ratio": self.hit_ratio.render(), "step-time": self.step_time.render(),
                "policy-effects": effects}

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.plan.name, "hit_ratio": self.hit_ratio.to_dict(), "step_time": self.step_time.to_dict(),
                "policy_effects": [g.to_dict() for g in self.effects]}


def build_report(plan: Plan = FULL, on_run: Callable[[str], None] | None = None) -> Report:
    config = RunConfig()
    return Report(
        plan, config,
        hit_ratio_section(plan.hit_requests, plan.capacities_tokens, config=config, on_run=on_run),
        step_time_section(),
        tuple(policy_effects(plan.slice_of(), max_search_runs=plan.max_search_runs, on_run=on_run)),
    )


TEMPLATE = """\
# Fidelity: how far to trust the simulator

What the simulator's answers are worth, checked against things it did not produce: an
independent replay of the bundled trace, the Mooncake paper, published step timings, and
each policy's effect at a load the system can sustain. The model behind it is described in
[`fidelity-model.md`](fidelity-model.md).

The tables are written by `kvlife fidelity`, which rewrites only the blocks between
`<!-- generated:NAME -->` and `<!-- /generated -->` markers and leaves this prose alone; the same
code writes the same file. `kvlife fidelity` with no flags rewrites `docs/fidelity.md` from
the repository root (a few minutes on two cores); `--quick` runs the same sections on small
slices in seconds, for tests and CI; `--json` prints the figures as one object.

```
kvlife fidelity --quick --out fidelity-quick.md
```

<!-- generated:setup -->
<!-- /generated -->

## Hit ratio against capacity

The engine runs the bundled conversation trace (`mooncake-conversation`, Apache-2.0) with
one host tier of each size and the baseline stack, arrivals as recorded. Beside it, an LRU
replay written independently of the engine (`kvlife.lifecycle.fidelity.lru_replay`: it reads
the trace itself and imports nothing from kvlife): requests in trace order, every prompt block
inserted (or refreshed) at lookup time, hits and misses alike, and a block counted as a hit
only if every earlier block of its prompt hit. "All blocks" counts every hash of the trace,
the partial last block included (Mooncake's accounting); "cacheable blocks" counts only the
full blocks before the last prompt token, which is what the engine's summary counts. The
theoretical maximum is the infinite-cache ratio. The paper figures are from Mooncake
(FAST '25): on the conversation trace, LRU at 3M tokens reaches 41 % of the maximum and 50M
tokens comes close to it.

<!-- generated:hit-ratio -->
<!-- /generated -->

## Step time predictions

The step-cost model (`kvlife.lifecycle.profiles.step_cost.StepCostModel`, default
efficiencies) against published measurements of the same steps. "Factor it set" names the
efficiency factor a measurement was used to derive (see the hardware profiles' comments): such
a row checks consistency, not prediction. Rows with "-" are independent checks.

<!-- generated:step-time -->
<!-- /generated -->

## Policy effects at a stable operating point

A policy's effect measured on an overloaded run says little: the queue grows without bound,
TTFT depends on the slice length, and verdicts flip with load. Each group below therefore
first searches the arrival time scale on the grid 1.25^k (from 1, galloping then bisecting)
for the highest point where its base run is stable: TTFT p50 under 2 s, and the mean TTFT of
the last arrival decile within 1.5x the first decile's, or at most 100 ms above it (at TTFTs of
tens of ms the ratio is noise; `kvlife.lifecycle.fidelity.stability`). Every variant then runs
the same slice at that point. "p50 change" and "p99 change" are against the row's
reference (the row above it in its pair); an effect under 5 % is called small, and a policy
meant to lower TTFT that raises it is flagged.

The conversation groups replay the trace with `sim.arrivals = "spread"`: its timestamps are
rounded to ~3 s with about 10 requests on each, and replayed as recorded those land in one
instant at any arrival rate, so TTFT p50 never drops under 2 s (2,052 ms at 0.001x on the
first 2,000 requests: the group's own prefill, not a queue). Spreading each group evenly up to
the next timestamp keeps the order, prompts and mean rate
([`fidelity-model.md`](fidelity-model.md#arrivals-workloadsarrivalspy)).

<!-- generated:policy-effects -->
<!-- /generated -->
"""


def check_document(text: str) -> None:
    """Raise ``DocumentError`` if the generated blocks of ``text`` cannot be rewritten."""
    md.replace_blocks(text, dict.fromkeys(SECTIONS, ""))


def render(report: Report, existing: str | None) -> str:
    """The document with the report's blocks written in (``existing`` None: from ``TEMPLATE``)."""
    return md.replace_blocks(existing if existing is not None else TEMPLATE, report.blocks())


def write_report(report: Report, path: str | Path) -> None:
    """Write the report's blocks into the document at ``path`` (the rest of it kept), through
    a temporary file renamed over it: a failed write leaves the document as it was."""
    from kvlife.lifecycle.input_files import read_limited
    from kvlife.lifecycle.output_files import write_output

    target = Path(path)
    existing = read_limited(target).decode("utf-8") if target.exists() else None
    write_output(target, render(report, existing).encode("utf-8"))
