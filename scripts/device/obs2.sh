#!/usr/bin/env bash
# Issue 41 device run 2: attnstore bench --tokens 128K, old (before the observability work,
# 7c93ecc) vs new (counters, spans, metrics compiled in, nothing installed), order swapped
# each pair; stops starting runs after 500 s.
cd "$(dirname "$0")/cpu"
start=$(date +%s)
for i in 1 2 3 4 5 6; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    [ $(( $(date +%s) - start )) -gt 500 ] && { echo "time up"; exit 0; }
    echo "{\"run\": $i}" >> "$OUT/ov_$w.jsonl"
    t0=$(date +%s); ./attnstore_$w bench --tokens 128K --json >> "$OUT/ov_$w.jsonl" 2>/dev/null
    echo "$w $i rc=$? $(( $(date +%s) - t0 )) s"
  done
done
