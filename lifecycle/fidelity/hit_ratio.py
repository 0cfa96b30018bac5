"""Hit ratio against host-tier capacity: the engine, an independent LRU replay, the Mooncake paper.

The engine runs the bundled conversation trace with one host tier of each capacity (the device
as the default config sizes it) and the baseline stack; its hit ratio is the run summary's
device + host prefix hit rate, over the blocks the summary counts (full blocks before the last
prompt token). ``lru_replay`` computes the same trace without the engine, over the same blocks
("cacheable") and over every block of the trace ("all", Mooncake's accounting, the one the
paper's figures use). The infinite-capacity replay is the theoretical maximum.

Where the engine and the replay differ, the difference is split with numbers: at infinite
capacity nothing is evicted, so what remains there is timing (a block is reusable only once
the request that computes it has stored it, while the replay inserts it at lookup); what a
finite capacity adds on top is eviction (the engine's tier index against the replay's LRU, the
device prefix cache in front of the host tier).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.fidelity import markdown as md
from kvlife.lifecycle.fidelity.lru_replay import Prompt, ReplayResult, counted_blocks, lru_replay, read_prompts
from kvlife.lifecycle.fidelity.runs import RunFigures, load, simulate, with_tiers

WORKLOAD = "mooncake-conversation"
AGREEMENT_POINTS = 0.02  # "within 2 points"; a larger gap gets its own explanation

PAPER_SOURCE = ("Mooncake (Qin et al., \"Mooncake: Trading More Storage for Less Computation\", FAST '25), "
                "section on the conversation trace's cache hit ratio under LRU")
PAPER = {3_000_000: ("41 % of max", 0.41), 50_000_000: ("close to max", None)}


@attrs.frozen
class CapacityRow:
    capacity_tokens: int | None  # None: infinite
    replay_all: ReplayResult
    replay_cacheable: ReplayResult
    engine: RunFigures
    engine_tier_blocks: int  # the host tier the engine ran with (infinite: every distinct block)

    @property
    def engine_device(self) -> float:
        return float(self.engine.summary["prefix_hit_rate"].get("device", 0.0))

    @property
    def engine_total(self) -> float:
        return float(sum(self.engine.summary["prefix_hit_rate"].values()))

    @property
    def gap(self) -> float:
        """Engine minus the replay over the same (cacheable) blocks, as a fraction."""
        return self.engine_total - self.replay_cacheable.hit_ratio


@attrs.frozen
class HitRatioSection:
    requests: int
    whole_trace: bool
    block_tokens: int
    time_scale: float
    distinct_blocks: int
    rows: tuple[CapacityRow, ...]  # infinite last

    @property
    def infinite(self) -> CapacityRow:
        return self.rows[-1]

    @property
    def max_gap(self) -> float:
        return max(abs(r.gap) for r in self.rows)

    @property
    def agrees(self) -> bool:
        return self.max_gap <= AGREEMENT_POINTS

    def to_dict(self) -> dict[str, Any]:
        best_all = self.infinite.replay_all.hit_ratio
        return {
            "workload": WORKLOAD, "requests": self.requests, "block_tokens": self.block_tokens,
            "time_scale": self.time_scale, "distinct_blocks": self.distinct_blocks,
            "device_blocks": self.infinite.engine.device_blocks, "max_gap": self.max_gap, "agrees": self.agrees,
            "rows": [{
                "capacity_tokens": r.capacity_tokens, "capacity_blocks": r.replay_all.capacity_blocks,
                "engine_tier_blocks": r.engine_tier_blocks,
                "replay_all": r.replay_all.hit_ratio,
                "replay_all_of_max": r.replay_all.hit_ratio / best_all if best_all else None,
                "replay_cacheable": r.replay_cacheable.hit_ratio,
                "engine": r.engine_total, "engine_device": r.engine_device,
                "engine_host": r.engine_total - r.engine_device, "gap": r.gap,
                "paper": PAPER.get(r.capacity_tokens or -1, (None, None))[0],
            } for r in self.rows],
        }

    def render(self) -> str:
        best_all = self.infinite.replay_all.hit_ratio
        rows = []
        for r in self.rows:
            blocks = r.replay_all.capacity_blocks
            rows.append([
                md.tokens(r.capacity_tokens),
                f"{blocks:,}" if blocks is not None else f"all ({self.distinct_blocks:,})",
                md.percent(r.replay_all.hit_ratio),
                md.percent(r.replay_all.hit_ratio / best_all if best_all else None, 0),
                PAPER.get(r.capacity_tokens or -1, ("-", None))[0] if r.capacity_tokens else "max",
                md.percent(r.replay_cacheable.hit_ratio),
                f"{md.percent(r.engine_total)} ({md.percent(r.engine_device)} + "
                f"{md.percent(r.engine_total - r.engine_device)})",
                md.points(r.gap),
            ])
        device = self.infinite.engine.device_blocks
        lines = [
            f"Workload: `{WORKLOAD}`, {'all ' if self.whole_trace else 'the first '}"
            f"{self.requests:,} requests, {self.block_tokens}-token blocks, {self.distinct_blocks:,} distinct "
            f"cacheable blocks; engine: baseline stack, arrivals at time scale {self.time_scale:g}, one host "
            f"tier of the given size, device prefix cache of "
            f"{f'{device:,} blocks' if device is not None else 'the default size'} (the default config).",
            "",
            md.table(
                ["host tier (tokens)", "blocks", "LRU replay, all blocks", "of max", "Mooncake paper",
                 "LRU replay, cacheable blocks", "engine (device + host)", "engine - replay"],
                rows,
            ),
            "",
            *self.explanation(),
        ]
        return "\n".join(lines)

    def explanation(self) -> list[str]:
        inf = self.infinite
        timing = inf.gap
        out = [
            f"- Theoretical maximum (infinite cache, LRU replay): {md.percent(inf.replay_all.hit_ratio)} of all "
            f"prompt blocks, {md.percent(inf.replay_cacheable.hit_ratio)} of cacheable blocks (the engine's "
            f"denominator: full blocks before the last prompt token).",
        ]
        paper_row = next((r for r in self.rows if r.capacity_tokens == 3_000_000), None)
        if paper_row is not None and inf.replay_all.hit_ratio:
            of_max = paper_row.replay_all.hit_ratio / inf.replay_all.hit_ratio
            out.append(f"- Against the paper: at 3M tokens the replay reaches {md.percent(of_max, 0)} of the "
                       f"maximum where the paper reports 41 % ({(of_max - 0.41) * 100:+.0f} points); at 50M tokens "
                       f"it reaches {md.percent(self._of_max(50_000_000), 0)}, the paper's \"close to the "
                       f"maximum\".")
        verdict = (f"within {AGREEMENT_POINTS * 100:g} points at every capacity" if self.agrees
                   else f"not within {AGREEMENT_POINTS * 100:g} points everywhere")
        out.append(f"- Engine against the independent replay (same blocks): largest difference "
                   f"{md.points(max(self.rows, key=lambda r: abs(r.gap)).gap)}, {verdict}.")
        out.append(f"- Where a difference comes from: at infinite capacity nothing is evicted, so the "
                   f"{md.points(timing)} left there is timing (a block is found only after the request computing "
                   f"it has stored it; the replay inserts at lookup). The device prefix cache serves "
                   f"{md.percent(inf.engine_device)} of the blocks before the host tier is asked.")
        for r in self.rows[:-1]:
            if abs(r.gap) > AGREEMENT_POINTS:
                out.append(f"- At {md.tokens(r.capacity_tokens)} tokens the engine is {md.points(r.gap)} off: "
                           f"{md.points(timing)} of timing (as at infinite capacity) and {md.points(r.gap - timing)} "
                           f"from eviction: the engine's host tier makes a block most recent when a request "
                           f"stores or loads it, after its prefill, where the replay does at lookup, and the "
                           f"device prefix cache in front of it serves {md.percent(r.engine_device)} of blocks.")
        return out

    def _of_max(self, capacity: int) -> float | None:
        row = next((r for r in self.rows if r.capacity_tokens == capacity), None)
        best = self.infinite.replay_all.hit_ratio
        return row.replay_all.hit_ratio / best if row is not None and best else None


def distinct_cacheable(prompts: Sequence[Prompt], block_tokens: int) -> int:
    return len({h for p in prompts for h in counted_blocks(p, "cacheable", block_tokens)})


def hit_ratio_section(limit: int | None, capacities_tokens: Sequence[int], time_scale: float = 1.0,
                      config: RunConfig | None = None,
                      on_run: Callable[[str], None] | None = None) -> HitRatioSection:
    """Replay and simulate the first ``limit`` requests (None: all) of the conversation trace at
    each capacity (tokens), and at infinite capacity."""
    from kvlife.lifecycle.workloads.bundled import resolve_workload

    base = config if config is not None else RunConfig()
    block_tokens = base.engine.block_tokens
    prompts = read_prompts(resolve_workload(WORKLOAD), limit)
    distinct = distinct_cacheable(prompts, block_tokens)
    workload = load(WORKLOAD, limit, time_scale, base)
    rows = []
    for capacity in [*sorted(capacities_tokens), None]:
        blocks = None if capacity is None else max(1, capacity // block_tokens)
        tier_blocks = blocks if blocks is not None else max(1, distinct)
        if on_run is not None:
            on_run(f"hit ratio, host {md.tokens(capacity)}")
        config = with_tiers(base, {"host": tier_blocks, "disk": 0, "remote": 0})
        rows.append(CapacityRow(
            capacity, lru_replay(prompts, blocks, "all", block_tokens),
            lru_replay(prompts, blocks, "cacheable", block_tokens),
            simulate(config, workload, WORKLOAD), tier_blocks,
        ))
    return HitRatioSection(len(prompts), limit is None, block_tokens, time_scale, distinct, tuple(rows))
