#!/usr/bin/env bash
# On the GPU machine: where a 128K hack2 decode step's device time goes (session 46).
# Staged by `benches/gpu/stage.sh`; run as `OUT=dir bash .gpu/profile.sh`.
# 1. ncu's per-kernel summary of 120 kernels of the batch-1 device step (f16 with PROFILE_F16=1);
# 2. traced batches of 4, 8 and 16 (`BATCHES`): the device span per batch step, so the
#    device time per request shows where the GPU saturates;
# 3. with CONNECTIONS="8 32": the batch of 16 under each CUDA_DEVICE_MAX_CONNECTIONS.
# SKIP_NCU=1 leaves out step 1; FRAC sets the Gpu tier's share (default 0.3; 1.0: no misses).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp}"
ncu=/usr/local/cuda/bin/ncu
codecs=hack2; [ -n "${PROFILE_F16:-}" ] && codecs="hack2 f16"; [ -n "${SKIP_NCU:-}" ] && codecs=
for codec in $codecs; do
  frac=0.05; [ "$codec" = hack2 ] && frac=0.3
  ATTNSTORE_BENCH_CODEC=$codec ATTNSTORE_BENCH_MAX_BATCH=1 ATTNSTORE_BENCH_GPU_FRAC=$frac timeout 150 \
    "$ncu" --launch-skip 400 --launch-count 120 --print-summary per-kernel --csv "$here/gpu_engine" 131072 \
    > "$out/ncu_$codec.csv" 2> "$out/ncu_$codec.err"
  echo "ncu $codec: rc $?, $(wc -l < "$out/ncu_$codec.csv") lines in $out/ncu_$codec.csv"
done
run_batch() {  # batch, tag
  ATTNSTORE_GPU_TRACE=1 ATTNSTORE_BENCH_CODEC=hack2 ATTNSTORE_BENCH_MAX_BATCH=$1 ATTNSTORE_BENCH_GPU_FRAC=${FRAC:-0.3} \
    timeout 200 "$here/gpu_engine" 131072 > "$out/b$2.jsonl" 2> "$out/b$2.err"
  python3 - "$out/b$2" <<'PY'
import json, re, statistics, sys
f = sys.argv[1]
spans = [int(x) for x in re.findall(r"device \(us\): (\d+)", open(f + ".err").read())][-200:]
row = next(json.loads(l) for l in open(f + ".jsonl") if '"engine_device_batch"' in l)
span = statistics.median(spans) if spans else float("nan")
print(f"batch {row['batch']} (connections {row.get('cuda_device_max_connections')}): step {row['time_us']} us, "
      f"device span {span} us, {span / row['batch']:.1f} us per request")
PY
}
for b in ${BATCHES:-4 8 16}; do run_batch "$b" "$b"; done
for c in ${CONNECTIONS:-}; do CUDA_DEVICE_MAX_CONNECTIONS=$c run_batch 16 "16_c$c"; done
