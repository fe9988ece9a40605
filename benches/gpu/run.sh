#!/usr/bin/env bash
# On the GPU machine: attnstore's CUDA decode kernels and PyTorch SDPA in the same command,
# then the ratios. Staged by `benches/gpu/stage.sh` into .gpu/; run as `bash .gpu/bench.sh`.
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
tokens="${1:-32768,131072,524288}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$here/gpu_decode" "$tokens" | tee "$out/attnstore_gpu.jsonl"
for t in ${tokens//,/ }; do
  if [ "$t" -le 524288 ]; then "$here/gpu_tiered" "$t" | tee -a "$out/attnstore_gpu.jsonl"; fi
  "$here/gpu_wave" "$t" | tee -a "$out/attnstore_gpu.jsonl"
  if [ "$t" -le 131072 ]; then "$here/gpu_engine" "$t" | tee -a "$out/attnstore_gpu.jsonl"; fi
done
python3 "$here/sdpa.py" "$tokens" | tee "$out/sdpa.jsonl"
python3 "$here/compare.py" "$out/attnstore_gpu.jsonl" "$out/sdpa.jsonl" | tee "$out/gpu_compare.txt"
