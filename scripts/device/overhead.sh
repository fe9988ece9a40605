#!/usr/bin/env bash
# Tracing and EXPLAIN ANALYZE compiled in and disabled (new) against the build before them
# (old), alternating with the order swapped each pair; then new with --log debug.
cd "$(dirname "$0")/cpu"
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    echo "{\"run\": $i}" >> "$OUT/ov_$w.jsonl"
    ./attnstore_$w bench --tokens 128K --json >> "$OUT/ov_$w.jsonl" 2>/dev/null
    echo "$w $i rc=$?"
  done
done
for i in 1 2; do
  echo "{\"run\": $i}" >> "$OUT/ov_enabled.jsonl"
  ./attnstore_new --log attnstore=debug bench --tokens 128K --json >> "$OUT/ov_enabled.jsonl" 2> "$OUT/ov_enabled_$i.log"
  echo "enabled $i rc=$? $(wc -l < "$OUT/ov_enabled_$i.log") log lines"
done
gzip -f "$OUT"/ov_enabled_*.log
