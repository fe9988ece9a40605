#!/usr/bin/env bash
# On the GPU machine: the engine's decode step at 128K (batch 1 and the f16 batch of six,
# `gpu_engine`) under two settings, alternating within one call, beside SDPA: "a" runs as
# is, "b" with the environment in $AB_ENV (e.g. AB_ENV="ATTNSTORE_SELECT_TWO_LAUNCHES=1").
# Then one eager trace of each (`ATTNSTORE_GPU_TRACE=device`, batch 1): the medians of the
# device phases over the last 150 traced steps. Staged by `benches/gpu/stage.sh`; run as
# `AB_ENV=... OUT=dir bash .gpu/ab.sh [ROUNDS]` (default 3; TOKENS, default 131072).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp}"
n="${TOKENS:-131072}"
side_env() { [ "$1" = b ] && echo "${AB_ENV:-}"; }
for r in $(seq 1 "${1:-3}"); do
  python3 "$here/sdpa.py" "$n" | grep '"sdpa' >> "$out/sdpa.jsonl"
  for side in a b; do
    env $(side_env $side) timeout 240 "$here/gpu_engine" "$n" | grep '^{' | sed "s/^{/{\"side\": \"$side\", \"round\": $r, /" >> "$out/ab.jsonl"
  done
done
if [ -z "${SKIP_TRACE:-}" ]; then
  for side in a b; do
    env $(side_env $side) ATTNSTORE_GPU_TRACE=device ATTNSTORE_BENCH_MAX_BATCH=1 timeout 240 "$here/gpu_engine" "$n" \
      > /dev/null 2> "$out/trace_$side.err"
  done
fi
python3 - "$out" <<'PY'
import json, re, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for l in (out / "ab.jsonl").read_text().splitlines()]
sdpa = [json.loads(l) for l in (out / "sdpa.jsonl").read_text().splitlines()]
for method in sorted({r["method"] for r in rows}):
    for side in "ab":
        xs = [r["time_us"] for r in rows if r["method"] == method and r["side"] == side]
        if xs:
            print(f"{method} {side}: " + " ".join(f"{x:.1f}" for x in xs) + f" us (median {statistics.median(xs):.1f})")
    pairs = [(a["time_us"], b["time_us"]) for a in rows for b in rows
             if a["method"] == b["method"] == method and a["side"] == "a" and b["side"] == "b" and a["round"] == b["round"]]
    if pairs:
        q = sorted(y / x for x, y in pairs)
        print(f"  b / a per round: min {q[0]:.3f} / median {q[len(q) // 2]:.3f} / max {q[-1]:.3f}")
for m in ("sdpa", "sdpa_batch4", "sdpa_batch_max"):
    xs = [s for s in sdpa if s.get("method") == m]
    if xs:
        print(f"{m} (batch {xs[0]['batch']}): " + " ".join(f"{s['time_us']:.1f}" for s in xs) + " us")
for side in "ab":
    f = out / f"trace_{side}.err"
    if not f.exists():
        continue
    lines = [l for l in f.read_text().splitlines() if "device (us):" in l][-150:]
    cols = [list(map(int, l.split("device (us):")[1].split())) for l in lines]
    cols = [c for c in cols if c and len(c) == len(cols[-1])]
    if cols:
        med = [statistics.median(c[i] for c in cols) for i in range(len(cols[-1]))]
        print(f"eager device phases {side} (medians of {len(cols)}): {med}")
PY
