#!/usr/bin/env bash
# The CPU bench of the old and new builds, alternating, on the device host's CPU; each run's
# JSON lines appended to $OUT/bench_{old,new}.jsonl after a {"run": i} line.
cd "$(dirname "$0")"  # .gpu/cpu when staged
nproc; lscpu | grep "Model name"
for i in 1 2 3 4 5; do
  for w in old new; do
    s=$(date +%s)
    echo "{\"run\": $i}" >> "$OUT/bench_$w.jsonl"
    ./attnstore_$w bench --tokens 128K --json >> "$OUT/bench_$w.jsonl" 2>> "$OUT/bench_$w.err"
    echo "bench $w $i rc=$? $(( $(date +%s) - s ))s"
  done
done
