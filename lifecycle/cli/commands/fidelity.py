"""``kvlife fidelity``: regenerate the fidelity report's tables (docs/fidelity.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag

DEFAULT_OUT = "docs/fidelity.md"


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "fidelity",
        help="regenerate the fidelity report (hit ratios, step times, policy effects at a stable point)",
        description="Run the fidelity report and rewrite the generated tables of its Markdown file: hit ratio "
                    "against host capacity (engine, an independent LRU replay, the Mooncake paper), step-time "
                    "predictions against published measurements, and each policy's effect at a stable "
                    "operating point. Only the blocks between <!-- generated:NAME --> and <!-- /generated --> "
                    "are rewritten; a missing file is created.\n\n"
                    "examples:\n"
                    "  kvlife fidelity                 # docs/fidelity.md, a few minutes\n"
                    "  kvlife fidelity --quick --out /tmp/fidelity.md",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="FILE.md",
                        help="the Markdown file to rewrite (its directory must exist)")
    parser.add_argument("--quick", action="store_true",
                        help="small slices, seconds instead of minutes (for tests and CI; default: the full report)")
    add_json_flag(parser, "the report's figures")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.fidelity.markdown import DocumentError
    from kvlife.lifecycle.fidelity.report import FULL, QUICK, build_report, check_document, write_report

    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {out.parent} does not exist")
    if out.exists() and not out.is_file():
        raise UsageError(f"--out {args.out}: not a file")
    if out.exists():  # refuse a document whose markers do not match before minutes of runs
        from kvlife.lifecycle.input_files import read_limited

        try:
            check_document(read_limited(out).decode("utf-8"))
        except (DocumentError, OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--out {args.out}: {exc}") from None
    plan = QUICK if args.quick else FULL
    with progress_bar("kvlife fidelity", unit="run") as bar:
        runs = 0

        def on_run(label: str) -> None:
            nonlocal runs
            runs += 1
            bar(runs, runs)

        report = build_report(plan, on_run)
    try:
        write_report(report, out)
    except DocumentError as exc:
        raise UsageError(f"--out {args.out}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot write: {exc.strerror or exc}") from None
    if args.json:
        output.emit("fidelity", out=str(out), runs=runs, **report.to_dict())
        return 0
    hit = report.hit_ratio
    worst = max(hit.rows, key=lambda r: abs(r.gap))
    print(f"kvlife fidelity: wrote {out} ({plan.name} mode, {runs} simulated runs)")
    print(f"hit ratio: engine against the independent LRU replay, largest difference "
          f"{worst.gap * 100:+.1f} points ({'within' if hit.agrees else 'not within'} 2 points at every capacity)")
    print("operating points: " + ", ".join(f"{g.group.key} {g.point.time_scale:g}"
                                           + ("" if g.point.found else " (none stable)") for g in report.effects))
    return 0
