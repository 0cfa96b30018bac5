"""Miss-ratio curves of a Mooncake trace: the prefix hit ratio at every cache capacity.

LRU, in one pass. Every counted block of every prompt is an access, in trace order, and
each access leaves its block most recent (a hit is touched, a miss is inserted): the
access stream of ``kvlife.lifecycle.fidelity.lru_replay``. The LRU *stack distance* of an
access is 1 + the number of distinct blocks accessed since the previous access to the
same block (infinite the first time), and by LRU's inclusion property a cache of ``C``
blocks holds the block at that moment iff its distance is ``<= C``. The prefix rule (a
block counts as a hit only if every earlier block of its prompt hit) then makes block
``i`` of a prompt a hit at ``C`` iff the largest distance among blocks ``0..i`` of that
prompt is ``<= C``: a histogram of that running maximum, summed up to ``C``, is the hit
count at every capacity at once. A block's own prompt counts in its distance exactly as
the replay interleaves it: earlier blocks of the prompt were made most recent just before.
Distances come from a Fenwick tree over access times holding a 1 at each block's latest
access: O(log n) per access.

OPT, per capacity. Belady's rule (evict the block whose next access is farthest away;
every accessed block is inserted, as the engine stores every block it computes) is run
at each capacity asked for, with the same prefix rule on its hits. OPT is a stack algorithm
(Mattson et al., "Evaluation techniques for storage hierarchies", IBM Systems Journal
9(2), 1970), so one pass could give every capacity: Mattson's OPT stack moves ~50 elements
per access on this trace (too slow in Python), and the O(log V) Critical Stack Algorithm of
Bilardi, Ekanadham and Pattnaik (CF 2017) is not implemented here; this module runs one
O(n log n) heap simulation per capacity instead.
Next-access times break every tie, so the runs are one stack algorithm and the curve is
monotone. With chained hashes (Mooncake's: hash ``i`` names the whole prefix up to block
``i``) the prefix rule never removes an OPT hit: the earlier blocks of a prompt are needed
again no later than the later ones, so OPT keeps them at least as long. OPT's prefix hits
are then its raw hits, at least LRU's raw hits, at least LRU's prefix hits: an upper bound
for any policy that stores every block. (For arbitrary hash lists, which are not chained,
the prefix rule can remove OPT hits and that bound is not guaranteed.)

Blocks counted, as in ``lru_replay``: ``"all"`` every hash of a prompt, the partial last
block included (Mooncake's accounting); ``"cacheable"`` the full blocks before the last
prompt token, ``(input_length - 1) // block_tokens`` (kvlife's run summary).

``output_blocks=True`` adds what else the engine stores, inserted after the prompt and never
counted: the prompt's full last block (``"cacheable"`` only: a prompt that ends on a block
boundary) and the blocks its output fills, ``(input_length + output_length) // block_tokens
- input_length // block_tokens`` fresh hashes that no later prompt of a Mooncake trace names
(its ids cover prompts only). They take LRU capacity, so the curve becomes the engine's.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from kvlife.lifecycle.workloads.mooncake import WorkloadError, iter_mooncake

BlockMode = Literal["all", "cacheable"]
BLOCK_MODES: tuple[BlockMode, ...] = ("all", "cacheable")
PLOT_POINTS = 16  # OPT capacities on a plotted curve, log-spaced from 10 blocks (plus the table's)


@attrs.frozen
class Prompts:
    """The counted blocks of each prompt of a trace, in trace order."""

    name: str
    blocks: tuple[tuple[int, ...], ...]  # every access of each prompt, counted ones first
    block_tokens: int
    mode: BlockMode
    counts: tuple[int, ...] | None = None  # counted accesses of each prompt (None: all of them)

    @property
    def counted(self) -> int:
        return sum(len(p) for p in self.blocks) if self.counts is None else sum(self.counts)

    @property
    def distinct(self) -> int:
        return len({b for p in self.blocks for b in p})


def counted(hash_ids: Sequence[int], input_length: int, mode: BlockMode, block_tokens: int) -> tuple[int, ...]:
    """The hashes of one prompt that are counted (and inserted)."""
    if mode == "all":
        return tuple(hash_ids)
    return tuple(hash_ids[: (input_length - 1) // block_tokens])


def read_trace(trace: str | os.PathLike[str], limit: int | None = None, mode: BlockMode = "all",
               block_tokens: int = 512, output_blocks: bool = False) -> Prompts:
    """A Mooncake JSON-lines trace (a path, ``.gz`` read as gzip, or a bundled name) read and
    checked by kvlife's reader: a bad line is a ``WorkloadError`` (``FILE:LINE: field 'x': ...``).
    ``output_blocks``: also insert, uncounted, what the engine stores besides (module doc)."""
    blocks: list[tuple[int, ...]] = []
    counts: list[int] = []
    fresh = -1  # trace hashes are >= 0: negative ids never collide with them
    for r in iter_mooncake(trace, limit=limit, block_tokens=block_tokens):
        prompt = counted(r.hash_ids, r.input_length, mode, block_tokens)
        counts.append(len(prompt))
        if output_blocks:
            full = r.input_length // block_tokens
            extra = list(r.hash_ids[len(prompt):full])
            for _ in range((r.input_length + r.output_length) // block_tokens - full):
                extra.append(fresh)
                fresh -= 1
            prompt += tuple(extra)
        blocks.append(prompt)
    if not blocks:  # as kvlife run refuses it: an empty workload is bad input, not a curve of nothing
        from kvlife.lifecycle.workloads.bundled import resolve_workload

        raise WorkloadError(os.fspath(resolve_workload(os.fspath(trace))), None, None, "no requests")
    return Prompts(os.fspath(trace), tuple(blocks), block_tokens, mode,
                   tuple(counts) if output_blocks else None)


# ---- LRU: stack distances in one pass ------------------------------------------------------
def lru_histogram(prompts: Iterable[Sequence[int]], counts: Sequence[int] | None = None) -> tuple[list[int], int]:
    """``(histogram, cold)``: ``histogram[d]`` counted blocks whose prompt-prefix maximum LRU
    stack distance is ``d`` (index 0 unused), ``cold`` those with an infinite one (a first
    access in their prefix). The hits of an LRU cache of ``C`` blocks are
    ``sum(histogram[1:C+1])``. ``counts[i]``: how many leading accesses of prompt ``i`` are
    counted (None: all); the rest are insertions only."""
    prompts = [tuple(p) for p in prompts]
    n = sum(len(p) for p in prompts)
    limits = [len(p) for p in prompts] if counts is None else list(counts)
    tree = [0] * (n + 1)  # Fenwick tree over access times 1..n: 1 at each block's latest access
    last: dict[int, int] = {}
    histogram = [0] * (n + 2)
    infinite = n + 1
    distinct = 0
    now = 0
    for prompt, limit in zip(prompts, limits, strict=True):
        worst = 0
        for k, block in enumerate(prompt):
            now += 1
            if k == limit:
                worst = infinite  # past the counted blocks: insertions only, no queries
            previous = last.get(block)
            if previous is None:
                distinct += 1
                worst = infinite
            else:
                if worst != infinite:  # the distance matters only while the prefix may still hit
                    seen = 0  # ones at times <= previous: blocks not accessed since
                    i = previous
                    while i:
                        seen += tree[i]
                        i &= i - 1
                    distance = distinct - seen + 1
                    if distance > worst:
                        worst = distance
                i = previous
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
            i = now
            while i <= n:
                tree[i] += 1
                i += i & -i
            last[block] = now
            if k < limit:
                histogram[worst] += 1
    cold = histogram[infinite]
    del histogram[distinct + 1:]  # no distance exceeds the number of distinct blocks
    return histogram, cold


def cumulative(histogram: Sequence[int]) -> list[int]:
    """``hits[C]`` for C = 0 .. len(histogram) - 1."""
    hits = [0] * len(histogram)
    total = 0
    for c in range(1, len(histogram)):
        total += histogram[c]
        hits[c] = total
    return hits


# ---- OPT: Belady per capacity --------------------------------------------------------------
def next_uses(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each access, the time of the next access to its block; never again: ``n + time``
    (distinct and later than every real access, so ties never arise)."""
    n = sum(len(p) for p in prompts)
    out = [[0] * len(p) for p in prompts]
    upcoming: dict[int, int] = {}
    now = n
    for pi in range(len(prompts) - 1, -1, -1):
        prompt = prompts[pi]
        row = out[pi]
        for bi in range(len(prompt) - 1, -1, -1):
            now -= 1
            block = prompt[bi]
            row[bi] = upcoming.get(block, n + now)
            upcoming[block] = now
    return out


def opt_hits(prompts: Sequence[Sequence[int]], nexts: Sequence[Sequence[int]], capacity: int,
             counts: Sequence[int] | None = None) -> int:
    """Prefix hits of Belady's OPT with ``capacity`` blocks, every accessed block inserted;
    ``counts`` as in ``lru_histogram``."""
    if capacity < 1:
        raise ValueError(f"capacity: expected an integer >= 1, got {capacity!r}")
    cache: dict[int, int] = {}  # block -> its next access
    heap: list[tuple[int, int]] = []  # (-next access, block); stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    limits = [len(p) for p in prompts] if counts is None else counts
    for prompt, row, limit in zip(prompts, nexts, limits, strict=True):
        prefix = True
        for k, (block, upcoming) in enumerate(zip(prompt, row, strict=True)):
            if k == limit:
                prefix = False  # insertions only
            if block in cache:
                if prefix:
                    hits += 1
            else:
                prefix = False
                if len(cache) >= capacity:
                    while True:
                        key, victim = pop(heap)
                        if cache.get(victim) == -key:
                            del cache[victim]
                            break
            cache[block] = upcoming
            push(heap, (-upcoming, block))
    return hits


# ---- the curve -----------------------------------------------------------------------------
@attrs.frozen
class Point:
    capacity_blocks: int | None  # None: infinite
    capacity_tokens: int | None  # as asked for (the blocks are its whole blocks); None: infinite
    lru_hits: int
    opt_hits: int | None  # None: OPT not computed

    def to_dict(self, curve: MissRatioCurve) -> dict[str, Any]:
        return {
            "capacity_tokens": self.capacity_tokens, "capacity_blocks": self.capacity_blocks,
            "lru_hits": self.lru_hits, "lru_hit_ratio": curve.ratio(self.lru_hits),
            "lru_of_max": curve.of_max(self.lru_hits),
            "opt_hits": self.opt_hits, "opt_hit_ratio": None if self.opt_hits is None else curve.ratio(self.opt_hits),
            "opt_of_max": None if self.opt_hits is None else curve.of_max(self.opt_hits),
        }


@attrs.frozen
class MissRatioCurve:
    """LRU hits at every capacity, OPT hits at the capacities computed."""

    name: str
    requests: int
    block_tokens: int
    mode: BlockMode
    counted: int  # blocks counted: the denominator
    distinct: int  # distinct blocks inserted (output blocks included)
    lru: tuple[int, ...]  # lru[C]: hits at C blocks, C = 0 .. distinct (beyond: lru[distinct])
    opt: dict[int, int]  # capacity blocks -> OPT hits
    lru_s: float  # wall time of the LRU pass
    opt_s: float  # wall time of the OPT runs

    @property
    def max_hits(self) -> int:
        """Hits with an infinite cache (no eviction: LRU and OPT alike)."""
        return self.lru[-1]

    def lru_hits(self, capacity_blocks: int | None) -> int:
        if capacity_blocks is None:
            return self.max_hits
        return self.lru[min(capacity_blocks, len(self.lru) - 1)]

    def opt_hits(self, capacity_blocks: int | None) -> int | None:
        if capacity_blocks is None or capacity_blocks >= self.distinct:
            return self.max_hits
        return self.opt.get(capacity_blocks)

    def ratio(self, hits: int) -> float | None:
        return hits / self.counted if self.counted else None

    def of_max(self, hits: int) -> float | None:
        return hits / self.max_hits if self.max_hits else None

    def point(self, capacity_blocks: int | None, capacity_tokens: int | None = None) -> Point:
        """The curve at ``capacity_blocks`` (None: infinite); ``capacity_tokens`` the capacity as
        asked for (default: the blocks' tokens)."""
        if capacity_tokens is None and capacity_blocks is not None:
            capacity_tokens = capacity_blocks * self.block_tokens
        return Point(capacity_blocks, capacity_tokens, self.lru_hits(capacity_blocks),
                     self.opt_hits(capacity_blocks))


def plot_capacities(distinct: int, points: int = PLOT_POINTS, lowest: int = 10) -> list[int]:
    """``points`` log-spaced capacities from ``lowest`` blocks (1 for a smaller trace) to every
    distinct block."""
    if distinct < 1:
        return []
    low = lowest if distinct > lowest else 1
    span = math.log(distinct / low)
    return sorted({max(1, round(low * math.exp(span * k / (points - 1)))) for k in range(points)})


def miss_ratio_curve(prompts: Prompts, opt_capacities: Iterable[int] = ()) -> MissRatioCurve:
    """The LRU curve in one pass, and OPT at each of ``opt_capacities`` (blocks)."""
    start = time.perf_counter()
    histogram, _ = lru_histogram(prompts.blocks, prompts.counts)
    lru = cumulative(histogram)
    lru_s = time.perf_counter() - start
    distinct = len(lru) - 1
    start = time.perf_counter()
    wanted = sorted({c for c in opt_capacities if 1 <= c < distinct})
    opt: dict[int, int] = {}
    if wanted:
        nexts = next_uses(prompts.blocks)
        for c in wanted:
            opt[c] = opt_hits(prompts.blocks, nexts, c, prompts.counts)
            if opt[c] == lru[-1]:  # the maximum: every larger capacity has it too (a stack algorithm)
                opt.update(dict.fromkeys((w for w in wanted if w > c), lru[-1]))
                break
    return MissRatioCurve(prompts.name, len(prompts.blocks), prompts.block_tokens, prompts.mode,
                          prompts.counted, distinct, tuple(lru), opt, lru_s, time.perf_counter() - start)


# ---- capacities as the command line gives them ---------------------------------------------
_SUFFIXES = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_size(text: str) -> int:
    """``3M``, ``500k``, ``1.5G``, ``5859``: a positive whole number (ValueError otherwise)."""
    raw = text.strip()
    if not raw.isascii():  # (float() reads "٣" as 3)
        raise ValueError(f"{text!r} is not a size (a number with an optional k, M or G: 3M, 500k)")
    factor = _SUFFIXES.get(raw[-1:].lower(), 1) if raw else 1
    number = raw[:-1] if factor != 1 else raw
    try:
        value = float(number) * factor
    except ValueError:
        raise ValueError(f"{text!r} is not a size (a number with an optional k, M or G: 3M, 500k)") from None
    if not math.isfinite(value) or value < 1 or value != int(value) or value > 2**63 - 1:
        raise ValueError(f"{text!r}: expected a whole number >= 1")
    return int(value)


def default_capacities_tokens(distinct: int, block_tokens: int) -> list[int]:
    """1-3-10 steps in tokens, from 10 blocks up to (not including) every distinct block."""
    out: list[int] = []
    decade = 10_000
    footprint = distinct * block_tokens
    while decade < footprint:
        for step in (decade, 3 * decade):
            if 10 * block_tokens <= step < footprint:
                out.append(step)
        decade *= 10
    return out


# ---- the plot ------------------------------------------------------------------------------
def plot_curve(curve: MissRatioCurve, out: str | Path, marked: Sequence[int] = ()) -> None:
    """``curve_figure`` written to ``out`` (its format checked first, and that it is not the
    trace it was measured on)."""
    from kvlife.lifecycle.traces.plot import check_image, save

    check_image(out, (curve.name,))
    save(curve_figure(curve, marked), out, (curve.name,))


def curve_figure(curve: MissRatioCurve, marked: Sequence[int] = ()) -> Any:
    """LRU (every capacity) and OPT (its points) against capacity in tokens, log scale, with
    the infinite-cache maximum; ``marked`` capacities (blocks) get a dotted line. Laid out
    as every kvlife plot is (``traces.plot``): the legend outside, plain tick numbers."""
    from kvlife.lifecycle.traces.plot import figure, outside_legend, plain_axes

    bt = curve.block_tokens
    fig, axes = figure(1, width=8.0, height=5.0)
    ax = axes[0][0]
    if curve.counted and curve.distinct:
        xs = plot_capacities(curve.distinct, 400)
        ax.step([c * bt for c in xs], [100 * curve.lru_hits(c) / curve.counted for c in xs], where="post",
                label="LRU (stack distances, every capacity)")
        opt = sorted(curve.opt.items())
        if opt:
            ax.plot([c * bt for c, _ in opt] + [curve.distinct * bt],
                    [100 * h / curve.counted for _, h in opt] + [100 * curve.max_hits / curve.counted],
                    marker="o", markersize=3, label="OPT (Belady, upper bound)")
        best = 100 * curve.max_hits / curve.counted
        ax.axhline(best, color="grey", linestyle="--", linewidth=1, label=f"infinite cache: {best:.1f} %")
        for c in marked:
            ax.axvline(c * bt, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        plain_axes(ax)
        outside_legend(ax)
    else:
        ax.text(0.5, 0.5, "the trace has no blocks", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"cache capacity (tokens; {bt}-token blocks)")
    ax.set_ylabel(f"prefix hit ratio (% of {curve.mode} prompt blocks)")
    ax.set_title(f"{Path(curve.name).name}: {curve.requests:,} requests")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    return fig
