#!/usr/bin/env bash
# Issue 41 device run 3: enabled — a Prometheus recorder installed (--metrics) and, second,
# also tracing at debug (--log attnstore=debug) — against old, interleaved.
cd "$(dirname "$0")/cpu"
start=$(date +%s)
for i in 1 2 3; do
  for w in old metrics both; do
    [ $(( $(date +%s) - start )) -gt 500 ] && { echo "time up"; exit 0; }
    echo "{\"run\": $i}" >> "$OUT/en_$w.jsonl"
    case $w in
      old) ./attnstore_old bench --tokens 128K --json >> "$OUT/en_$w.jsonl" 2>/dev/null ;;
      metrics) ./attnstore_new --metrics "$OUT/metrics_$i.prom" bench --tokens 128K --json >> "$OUT/en_$w.jsonl" 2>/dev/null ;;
      both) ./attnstore_new --metrics /dev/null --log attnstore=debug bench --tokens 128K --json >> "$OUT/en_$w.jsonl" 2> "$OUT/en_both_$i.log" ;;
    esac
    echo "$w $i rc=$?"
  done
done
gzip -f "$OUT"/en_both_*.log
