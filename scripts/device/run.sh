#!/usr/bin/env bash
# GPU tests of the new build, then gpu_engine old/new alternating.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mode=${1:-tests}
if [ "$mode" = tests ]; then
  fail=0
  for t in .gpu/bin/*; do
    echo "== $t"
    ATTNSTORE_GPU=1 "$t" --test-threads=1 2>&1 | grep -E "^test |test result|panicked|skip" | tail -40 || fail=1
    [ "${PIPESTATUS[0]}" = 0 ] || fail=1
  done
  echo "tests fail=$fail"
  shift
fi
for spec in "$@"; do
  which=${spec%%:*}; tok=${spec##*:}
  echo "== $which gpu_engine $tok"
  .gpu/$which/gpu_engine $tok 2>/dev/null | tee -a "$OUT/engine_${which}_${tok}.jsonl" | python3 -c '
import json,sys
for l in sys.stdin:
    try: r=json.loads(l)
    except Exception: continue
    print(r.get("method"), r.get("batch"), r.get("time_us"), r.get("plan_us",""), r.get("hit_ratio",""))'
done
