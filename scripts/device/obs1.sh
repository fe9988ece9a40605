#!/usr/bin/env bash
# Issue 41 device run 1: GPU tests (incl. EXPLAIN ANALYZE on the GPU), explain --analyze --gpu, buffer_bench plan pairs.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for t in bin/*; do
  echo "== $t"
  ATTNSTORE_GPU=1 "$t" --test-threads=1 > "$OUT/test_$(basename $t).log" 2>&1
  echo "rc=$?"; grep -E "^test |test result|panicked" "$OUT/test_$(basename $t).log" | tail -20
done
ATTNSTORE_GPU=1 bin/gpu explain_analyze --nocapture > "$OUT/gpu_analyze.txt" 2>&1; echo "analyze rc=$?"
for tok in 128K 512K; do
  cpu/attnstore_cuda explain --tokens $tok --analyze --gpu > "$OUT/explain_gpu_$tok.txt" 2>"$OUT/explain_gpu_$tok.err"; echo "explain $tok rc=$?"
  cpu/attnstore_cuda explain --tokens $tok --analyze --gpu --json > "$OUT/explain_gpu_$tok.json" 2>/dev/null
done
for i in 1 2 3 4 5 6; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for w in $order; do
    echo "== run $i" >> "$OUT/bb_$w.txt"
    timeout 120 cpu/buffer_bench_$w plan >> "$OUT/bb_$w.txt" 2>&1; echo "bb $w $i rc=$?"
  done
done
