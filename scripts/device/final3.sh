#!/usr/bin/env bash
# GPU tests of the final build (after the cuda/wave split), one gpu_engine pair new first,
# then the CPU bench with the new binary first in each pair.
cd "$(dirname "$0")/.."
bash .gpu/run.sh tests 2>&1 | grep -E "^==|test result|FAILED|panicked|fail=|skip"
bash .gpu/run.sh bench new:131072 old:131072 2>&1 | grep -v "^NVIDIA"
cd .gpu/cpu
for i in 1 2 3 4 5; do
  for w in new old; do
    s=$(date +%s)
    echo "{\"run\": $i}" >> "$OUT/bench2_$w.jsonl"
    ./attnstore_$w bench --tokens 128K --json >> "$OUT/bench2_$w.jsonl" 2>> "$OUT/bench2_$w.err"
    echo "bench $w $i rc=$? $(( $(date +%s) - s ))s"
  done
done
