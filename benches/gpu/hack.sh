#!/usr/bin/env bash
# On the GPU machine: the hack2 codec's homomorphic decode, dequantize-then-attend and the
# exact f16 kernel, then PyTorch SDPA over f16 KV, in the same command, and the ratios.
# Staged by `benches/gpu/stage.sh` into .gpu/; run as `bash .gpu/hack.sh [tokens,...]`.
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
tokens="${1:-32768,131072}"
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$here/gpu_hack" "$tokens" | tee "$out/hack_gpu.jsonl"
python3 "$here/sdpa.py" "$tokens" | tee "$out/hack_sdpa.jsonl"
python3 "$here/compare.py" "$out/hack_gpu.jsonl" "$out/hack_sdpa.jsonl" | tee "$out/hack_compare.txt"
