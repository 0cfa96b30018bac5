"""``kvlife mrc TRACE``: the prefix hit ratio at every cache capacity, LRU in one pass, OPT above it."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag, name_or_path
from kvlife.lifecycle.config import REQUESTS, flag_type

if TYPE_CHECKING:
    from kvlife.lifecycle.fidelity.mrc import MissRatioCurve, Point


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "mrc", help="hit ratio at every cache capacity from one pass over a trace (LRU, and OPT as the bound)",
        description="Miss-ratio curve of a Mooncake trace: the prefix hit ratio an LRU cache of every capacity "
                    "would reach, from one pass of stack distances, and Belady's OPT (the upper bound for a cache "
                    "that stores every block) at the capacities shown. A block is a hit only if every earlier block "
                    "of its prompt hit. Each figure is also given as a share of the infinite-cache maximum "
                    "(docs/mrc.md).\n\n"
                    "examples:\n"
                    "  kvlife mrc mooncake-conversation --capacities 3M,10M,50M\n"
                    "  kvlife mrc trace.jsonl.gz --blocks cacheable --json\n"
                    "  kvlife mrc mooncake-conversation --limit 2000 --plot mrc.png")
    parser.add_argument("trace", type=name_or_path, metavar="TRACE",
                        help="a Mooncake JSON-lines file (.gz is read as gzip) or a bundled workload "
                             "(mooncake-conversation)")
    parser.add_argument("--limit", type=REQUESTS.parse, metavar="N",
                        help="use only the first N requests (default: all)")
    parser.add_argument("--capacities", metavar="LIST",
                        help="comma-separated capacities, e.g. 3M,10M,50M (k, M, G suffixes), in --unit "
                             "(default: 10k, 30k, 100k, ... tokens up to the trace's footprint)")
    parser.add_argument("--unit", choices=("tokens", "blocks"), default="tokens",
                        help="what --capacities counts")
    parser.add_argument("--blocks", choices=("all", "cacheable"), default="all",
                        help="blocks counted: every block of each prompt, the partial last one included (Mooncake's "
                             "accounting), or the full blocks before the last prompt token (kvlife run's summary)")
    parser.add_argument("--block-tokens", type=flag_type("engine.block_tokens"), default=512, metavar="N",
                        help="tokens per block of the trace's hash_ids (config: engine.block_tokens)")
    parser.add_argument("--output-blocks", action="store_true",
                        help="also insert, never counted, what the engine stores besides the counted blocks: the "
                             "blocks each request's output fills (and a prompt's full last block): the curve a "
                             "kvlife run with a host tier reproduces (default: prompt blocks only, as the "
                             "independent LRU replay)")
    parser.add_argument("--no-opt", action="store_true",
                        help="skip Belady's OPT (one simulation per capacity; LRU alone is one pass)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the LRU and OPT curves to this image (needs kvlife[plot]; default: no plot)")
    add_json_flag(parser, "the curve at each capacity")
    parser.set_defaults(func=handle)


def _capacities(args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """--capacities as (tokens, blocks): a token count rounds down to whole blocks, at least one."""
    from kvlife.lifecycle.fidelity.mrc import parse_size

    if args.capacities is None:
        return None
    out: list[tuple[int, int]] = []
    for part in args.capacities.split(","):
        try:
            size = parse_size(part)
        except ValueError as exc:
            raise UsageError(f"argument --capacities: {exc}") from None
        if args.unit == "blocks":
            out.append((size * args.block_tokens, size))
        else:
            out.append((size, max(1, size // args.block_tokens)))
    return out


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.fidelity import mrc

    capacities = _capacities(args)
    if args.plot is not None:
        from kvlife.lifecycle.cli.extras import require

        require("matplotlib", "plot", "kvlife mrc --plot")
        from kvlife.lifecycle.traces.plot import check_image
        from kvlife.lifecycle.workloads.bundled import resolve_workload

        check_image(args.plot, (resolve_workload(args.trace),))  # a bad extension is refused before the work
    start = time.perf_counter()
    prompts = mrc.read_trace(args.trace, args.limit, args.blocks, args.block_tokens, args.output_blocks)
    read_s = time.perf_counter() - start
    distinct = prompts.distinct
    if capacities is None:
        capacities = [(t, t // args.block_tokens)
                      for t in mrc.default_capacities_tokens(distinct, args.block_tokens)]
    table = sorted(set(capacities))
    opt_at: list[int] = []
    if not args.no_opt:
        opt_at = [b for _, b in table] + (mrc.plot_capacities(distinct) if args.plot is not None else [])
    curve = mrc.miss_ratio_curve(prompts, opt_at)
    if args.plot is not None:
        mrc.plot_curve(curve, args.plot, [b for _, b in table])
    points = [curve.point(b, t) for t, b in table] + [curve.point(None)]
    wall_s = time.perf_counter() - start
    if args.json:
        output.emit("mrc", trace=args.trace, requests=curve.requests, block_tokens=curve.block_tokens,
                    blocks=curve.mode, output_blocks=args.output_blocks, counted_blocks=curve.counted,
                    distinct_blocks=curve.distinct,
                    max_hit_ratio=curve.ratio(curve.max_hits),
                    opt="per capacity" if opt_at else None,
                    rows=[p.to_dict(curve) for p in points],
                    curve=[curve.point(c).to_dict(curve) for c in sorted(curve.opt)] if args.plot else None,
                    plot=args.plot, read_s=read_s, lru_s=curve.lru_s, opt_s=curve.opt_s, wall_s=wall_s)
        return 0
    print(render(curve, points, read_s, wall_s, bool(opt_at), args.output_blocks))
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def render(curve: MissRatioCurve, points: list[Point], read_s: float, wall_s: float, with_opt: bool,
           output_blocks: bool = False) -> str:
    """The table: one row per capacity, the infinite one last."""
    from kvlife.lifecycle.fidelity import markdown as md

    what = ("every block of each prompt" if curve.mode == "all"
            else "the full blocks before each prompt's last token")
    rows = []
    for p in points:
        rows.append([
            md.tokens(p.capacity_tokens),
            f"{p.capacity_blocks:,}" if p.capacity_blocks is not None else f"all ({curve.distinct:,})",
            md.percent(curve.ratio(p.lru_hits)), md.percent(curve.of_max(p.lru_hits), 0),
            md.percent(curve.ratio(p.opt_hits)) if p.opt_hits is not None else "-",
            md.percent(curve.of_max(p.opt_hits), 0) if p.opt_hits is not None else "-",
        ])
    lines = [
        f"{curve.name}: {curve.requests:,} requests, {curve.counted:,} blocks counted ({what}, "
        f"{curve.block_tokens} tokens each), {curve.distinct:,} distinct"
        + (" blocks stored (output blocks included: uncounted)" if output_blocks else ""),
        f"infinite cache: {md.percent(curve.ratio(curve.max_hits))} of blocks hit (the maximum; "
        f"\"of max\" below is a share of it)",
        "",
        md.table(["capacity (tokens)", "blocks", "LRU", "of max", "OPT", "of max"], rows),
        "",
        f"LRU: one pass of stack distances ({curve.lru_s:.2f} s); "
        + (f"OPT: Belady, one run per capacity ({curve.opt_s:.2f} s); " if with_opt else "OPT: skipped; ")
        + f"{wall_s:.2f} s in all, reading included ({read_s:.2f} s)",
    ]
    return "\n".join(lines)
