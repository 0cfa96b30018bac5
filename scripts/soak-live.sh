#!/usr/bin/env bash
# Live soak: run `kvlife run --live` for about ten minutes and sample its resident memory
# every 5 s; print the samples, the warm-up peak and the drift after warm-up.
#
#   bash scripts/soak-live.sh [REQUESTS] [WARMUP_S]     (default: 2400 requests, 60 s)
#
# 2,400 requests of the synthetic workload at time scale 1 (4 requests/s) arrive over ~10
# minutes. The target (issue 12): RSS flat within 5 % after warm-up.
set -euo pipefail
requests=${1:-2400}
warmup=${2:-60}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
kvlife run --live --limit "$requests" --time-scale 1 --json >"$out/summary.json" 2>"$out/stderr" &
pid=$!
start=$(date +%s)
while kill -0 "$pid" 2>/dev/null; do
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
  [ -n "$rss" ] && echo "$(( $(date +%s) - start )) $rss" >>"$out/rss"
  sleep 5
done
status=0
wait "$pid" || status=$?
python3 - "$out/rss" "$warmup" "$status" <<'PY'
import sys
rows = [tuple(map(int, line.split())) for line in open(sys.argv[1]) if line.strip()]
warmup, status = int(sys.argv[2]), int(sys.argv[3])
after = [kb for t, kb in rows if t >= warmup]
print(f"samples {len(rows)} every 5 s over {rows[-1][0]} s; kvlife exit {status}")
if after:
    low, high = min(after), max(after)
    print(f"after {warmup} s warm-up: RSS {low / 1024:.1f}-{high / 1024:.1f} MiB, "
          f"first {after[0] / 1024:.1f}, last {after[-1] / 1024:.1f}, spread {(high - low) / low:.2%}")
PY
exit "$status"
