#!/usr/bin/env bash
# On the GPU machine: decode throughput of one layer at 128K (32 q / 8 kv heads, d = 128)
# at each one's largest batch, in one command: attnstore's device step with f16 rows and
# with hack2 rows (KV homed in pinned host memory, a 5% Gpu tier; the batch a 100 GiB host
# budget holds for a 32-layer model), and PyTorch SDPA with the KV in HBM (the batch the
# GPU's memory holds beside an 8B model's weights). Staged by `benches/gpu/stage.sh`; run as
# `bash .gpu/batch.sh [ROUNDS]`: each round runs all three, so ratios are same-round
# (`SKIP_HACK2=1`: SDPA and f16 only; `SKIP_F16=1`: SDPA and hack2 only; `HACK2_MAX_BATCH`:
# cap the hack2 batch; `BATCH_RUNS=N`: SDPA N times and the hack2 batch measured N times in
# its process, paired in order). CUDA_DEVICE_MAX_CONNECTIONS, when set, passes through to the
# engine's runs (the rows record it): how many hardware queues the lanes' streams share.
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp}"
rounds="${1:-1}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
free -g | head -2
for r in $(seq 1 "$rounds"); do
  echo "round $r"
  for i in $(seq 1 "${BATCH_RUNS:-1}"); do
    python3 "$here/sdpa.py" 131072 | grep '"sdpa_batch' | tee -a "$out/sdpa.jsonl"
  done
  if [ -z "${SKIP_F16:-}" ]; then
    "$here/gpu_engine" 131072 | tee -a "$out/engine_f16.jsonl"
  fi
  if [ -z "${SKIP_HACK2:-}" ]; then
    export ATTNSTORE_BENCH_BATCH_RUNS="${BATCH_RUNS:-1}"
    # HACK2_GPU_FRAC: the hack2 run's Gpu-tier share (e.g. 0.3: about f16's 5% in bytes).
    export ATTNSTORE_BENCH_GPU_FRAC="${HACK2_GPU_FRAC:-0.05}"
    ATTNSTORE_BENCH_CODEC=hack2 ATTNSTORE_BENCH_MAX_BATCH="${HACK2_MAX_BATCH:-64}" "$here/gpu_engine" 131072 \
      | tee -a "$out/engine_hack2.jsonl"
  fi
done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = lambda f: [json.loads(l) for l in (out / f).read_text().splitlines() if l.startswith("{")] if (out / f).exists() else []
sdpa = [r for r in rows("sdpa.jsonl") if r["method"] == "sdpa_batch_max"]
for codec, f in (("f16", "engine_f16.jsonl"), ("hack2", "engine_hack2.jsonl")):
    ours = [r for r in rows(f) if r.get("method") == "engine_device_batch"]
    ratios = []
    for a, s in zip(ours, sdpa):
        mine, theirs = a["batch"] / a["time_us"], s["batch"] / s["time_us"]
        ratios.append(mine / theirs)
        print(f"{codec}: attnstore batch {a['batch']} in {a['time_us']} us ({a['batch'] / a['time_us'] * 1e6:.0f} tokens/s per layer), "
              f"SDPA batch {s['batch']} in {s['time_us']} us ({s['batch'] / s['time_us'] * 1e6:.0f}): {mine / theirs:.2f}x")
    if ratios:
        ratios.sort()
        print(f"{codec} throughput / SDPA's at each one's largest batch: min {ratios[0]:.2f} / median {ratios[len(ratios) // 2]:.2f} / max {ratios[-1]:.2f}")
PY
