"""``kvlife profile-gpu``: time a model's step shapes on this machine's CUDA GPU, write a CSV for calibrate."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag, positive_int


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "profile-gpu", help="time a model's step shapes on this CUDA GPU and write the CSV calibrate fits",
        description="Time one transformer layer (and the lm_head) of the model's shapes, with random bf16 "
                    "weights, for a grid of prefill chunks, decode batches and mixed steps, on this machine's "
                    "CUDA GPU, and write prefill_tokens,decode_requests,context_tokens,step_ms rows for "
                    "`kvlife calibrate --no-comm`. Nothing is downloaded. Needs torch with CUDA; on a machine "
                    "without a GPU it exits 2 with one line.\n\n"
                    "example:\n"
                    "  kvlife profile-gpu --model llama-3-8b -o steps.csv && "
                    "kvlife calibrate steps.csv --no-comm -o fit.toml")
    parser.add_argument("--model", default="llama-3-8b", metavar="NAME|FILE.toml",
                        help="model profile whose shapes are timed (a bundled name or a TOML file)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="time one rank's shard at this tensor-parallel degree")
    parser.add_argument("--repeats", type=positive_int, default=5, metavar="N", help="timings per shape (median)")
    parser.add_argument("-o", "--output", metavar="FILE.csv",
                        help="where to write the rows (default: MODEL-tpN-steps.csv)")
    add_json_flag(parser, "what was written")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.drivers.physics import model_profile
    from kvlife.lifecycle.profiles.derived import check_tp
    from kvlife.lifecycle.profiles.profile_gpu import ProfileGpuError, profile_gpu

    model = model_profile(args.model)
    check_tp(model, args.tp)
    out = args.output or f"{model.name}-tp{args.tp}-steps.csv"
    try:
        with progress_bar("kvlife profile-gpu", unit="shape") as progress:
            path = profile_gpu(model, out, args.tp, repeats=args.repeats, progress=progress)
    except ProfileGpuError as exc:
        raise UsageError(str(exc)) from None
    rows = sum(1 for line in path.read_text().splitlines() if line and not line.startswith(("#", "prefill")))
    if args.json:
        output.emit("profile-gpu", model=model.name, tp=args.tp, repeats=args.repeats, output=str(path), rows=rows)
        return 0
    print(f"kvlife profile-gpu: {rows} steps of {model.name} (tp {args.tp}) timed; wrote {path}")
    print(f"fit them: kvlife calibrate {path} --model {args.model} --tp {args.tp} --no-comm -o fit.toml")
    return 0
