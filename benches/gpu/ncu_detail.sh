#!/usr/bin/env bash
# On the GPU machine: ncu's full sections for one launch of each kernel named in KERNELS
# (default hack_arena_g4) during a batch-1 128K hack2 device step, with per-SASS-line stall
# samples (where each warp waits). Staged by `benches/gpu/stage.sh`; run as
# `OUT=dir [KERNELS="hack_arena_g4 est_partial_g4"] [CODEC=hack2] bash .gpu/ncu_detail.sh`.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp}"
ncu=/usr/local/cuda/bin/ncu
codec=${CODEC:-hack2}
frac=0.05; [ "$codec" = hack2 ] && frac=0.3
for k in ${KERNELS:-hack_arena_g4}; do
  ATTNSTORE_BENCH_CODEC=$codec ATTNSTORE_BENCH_MAX_BATCH=1 ATTNSTORE_BENCH_GPU_FRAC=$frac timeout 200 \
    "$ncu" --kernel-name "$k" --launch-skip 30 --launch-count 1 --set full --import-source yes \
    -f -o "$out/$k" "$here/gpu_engine" 131072 > "$out/$k.log" 2>&1
  echo "ncu $k: rc $?"
  "$ncu" -i "$out/$k.ncu-rep" --page details > "$out/$k.details.txt" 2>&1
  "$ncu" -i "$out/$k.ncu-rep" --page source --print-source sass --csv > "$out/$k.sass.csv" 2>&1
  grep -E "Duration|Registers|Achieved Occupancy|Issue Slots Busy|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|No Eligible|Active Warps Per" "$out/$k.details.txt" | head -20
  rm -f "$out/$k.log"
done
