"""``kvlife calibrate FILE.csv``: fit the step-cost efficiency factors to measured step times."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, positive_int


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "calibrate", help="fit the step-cost efficiency factors (mfu, attention, mbu, overhead) to measured steps",
        description="Fit the step-cost model's efficiency factors (mfu, attention, mbu, overhead_ms; "
                    "docs/fidelity-model.md) to a CSV of measured step times, with columns "
                    "prefill_tokens,decode_requests,context_tokens,step_ms (what `kvlife profile-gpu` writes), "
                    "and print them; -o writes them as a profile that `kvlife run --efficiency FILE.toml` "
                    "(config: sim.efficiency) uses.\n\n"
                    "example:\n"
                    "  kvlife calibrate steps.csv --model llama-3-8b --hardware h100-sxm -o h100-fit.toml")
    parser.add_argument("csv", metavar="FILE.csv", help="measured steps: prefill_tokens,decode_requests,"
                                                        "context_tokens,step_ms (# lines are comments)")
    parser.add_argument("--model", default="llama-3-8b", metavar="NAME|FILE.toml",
                        help="the model the steps ran (a bundled profile name or a TOML file)")
    parser.add_argument("--hardware", default="h100-sxm", metavar="NAME|FILE.toml",
                        help="the GPU they ran on (a bundled profile name or a TOML file)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel degree of the steps")
    parser.add_argument("--no-comm", action="store_true",
                        help="the times hold no all-reduce (profile-gpu times one rank's shard on one GPU): "
                             "fit without the model's communication term")
    parser.add_argument("-o", "--output", metavar="FILE.toml",
                        help="write the fitted factors here, an [efficiency] table (default: print only)")
    add_json_flag(parser, "the fit")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.drivers.physics import hardware_profile, model_profile
    from kvlife.lifecycle.output_files import check_output
    from kvlife.lifecycle.profiles.calibrate import calibrate
    from kvlife.lifecycle.profiles.derived import check_tp

    if args.output is not None:  # before the fit: an output that would destroy an input is refused first
        check_output(args.output, (args.csv, args.model, args.hardware))
    model = model_profile(args.model)
    hardware = hardware_profile(args.hardware)
    check_tp(model, args.tp)
    result = calibrate(args.csv, model, hardware, args.tp, out=args.output, include_comm=not args.no_comm)
    e = result.efficiency
    start = hardware.efficiency
    factors = {"mfu": e.mfu, "attention": e.attention, "mbu": e.mbu, "overhead_ms": e.overhead_ms}
    if args.json:
        output.emit("calibrate", csv=args.csv, model=model.name, hardware=hardware.name, tp=args.tp,
                    rows=result.rows, fitted_rows=result.fitted_rows, efficiency=factors,
                    profile_efficiency={"mfu": start.mfu, "attention": start.attention, "mbu": start.mbu,
                                        "overhead_ms": start.overhead_ms},
                    rms_relative_error=result.rms_relative_error, max_relative_error=result.max_relative_error,
                    fixed=list(result.fixed), output=args.output)
        return 0
    sample = f" (fitted on every {-(-result.rows // result.fitted_rows)}th: {result.fitted_rows:,})" \
        if result.fitted_rows < result.rows else ""
    print(f"kvlife calibrate: {args.csv}, {result.rows:,} steps{sample} of {model.name} on {hardware.name}, "
          f"tp {args.tp}")
    print(f"{'factor':<12} {'fitted':>9} {'profile':>9}")
    for name, value in factors.items():
        note = "  (not identifiable from these steps: kept)" if name in result.fixed else ""
        print(f"{name:<12} {value:>9.4f} {getattr(start, name):>9.4f}{note}")
    print(f"relative error of the fit: rms {result.rms_relative_error:.1%}, max {result.max_relative_error:.1%}")
    if args.output:
        print(f"wrote {args.output} (use it: kvlife run --efficiency {args.output})")
    return 0
