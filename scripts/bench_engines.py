"""CPU time of ``runner.run_workload`` on a whole bundled workload, per engine, tracing off and on.

    python scripts/bench_engines.py [--workload mooncake-conversation] [--engines python,native] [--repeat 3]

Prints, per engine and tracing, the median of ``--repeat`` runs (``time.process_time``: the
CPU time of this process) and each run's figure. The trace goes to a temporary file. The
config is ``kvlife run``'s default (``RunConfig()``); ``--breakdown`` keeps the per-request
rows as ``kvlife run`` does.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.fidelity.runs import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mooncake-conversation")
    parser.add_argument("--engines", default="python,native")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    config = RunConfig()
    workload = load(args.workload, None, 1.0, config)
    print(f"{args.workload}: {len(workload)} requests")
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines.split(","):
            for trace in (False, True):
                times = []
                for _ in range(args.repeat):
                    path = Path(tmp) / f"{engine}.jsonl" if trace else None
                    start = time.process_time()
                    run_workload(config, workload, trace_path=path, engine=engine, breakdown=args.breakdown)
                    times.append(time.process_time() - start)
                runs = ", ".join(f"{t:.3f}" for t in times)
                print(f"{engine:<7} trace {'on ' if trace else 'off'}: {statistics.median(times):.3f} s CPU "
                      f"(median of {runs})", flush=True)


if __name__ == "__main__":
    main()
