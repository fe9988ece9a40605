#!/usr/bin/env bash
# On the GPU machine: issue 39's end-to-end call, the most important step first, each under
# its own timeout (a slow step leaves the others their time), output teed into $OUT:
#  1. the ingest profile on the GPU engine, 128K tokens, 3 layers (session 58's staging:
#     `python/examples/ingest_profile.py`, `docs/python.md` "Ingest");
#  2. `python/examples/hf_gpu_bench.py` at 128K: attnstore with hack2 rows at batch $BATCH
#     (default 8) in a $HOST_GIB GiB pinned arena (default 60) against SDPA's DynamicCache at
#     batch $SDPA_BATCH (default 3: 48 GiB of KV and 16 GB of weights in HBM);
#  3. the same with f16 rows at batch $F16_BATCH (default 3, arena sized by the bench).
# Staging: the cuda wheel in .gpu/ (`cd python && maturin build --release --features cuda
# -o ../.gpu`); carry [".gpu"]; run `timeout 590 bash scripts/device/e2e.sh`.
set -uo pipefail
rm -rf .pysite && python3 -m pip install -q --no-index --no-deps --target .pysite .gpu/*.whl || exit 1
export PYTHONPATH=$PWD/.pysite LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
echo "== 1. ingest, GPU engine, 128K, 3 layers"
timeout 120 python3 python/examples/ingest_profile.py --tokens 131072 --layers 3 --to-host staged,f32 --json 2>&1 \
  | grep -v Warning | tee "$OUT/ingest.txt"
common=(--contexts 131072 --sdpa-batch "${SDPA_BATCH:-3}" --sdpa-cache dynamic --rounds 3 --steps 5)
echo "== 2. 128K, hack2 rows, batch ${BATCH:-8}"
timeout "${HACK2_S:-300}" python3 python/examples/hf_gpu_bench.py "${common[@]}" --batch "${BATCH:-8}" \
  --codec hack2 --host-gib "${HOST_GIB:-60}" --json-out "$OUT/e2e-hack2.json" 2>&1 | grep -v Warning | tee "$OUT/e2e-hack2.txt"
echo "== 3. 128K, f16 rows, batch ${F16_BATCH:-3}"
timeout "${F16_S:-240}" python3 python/examples/hf_gpu_bench.py "${common[@]}" --batch "${F16_BATCH:-3}" \
  --json-out "$OUT/e2e-f16.json" 2>&1 | grep -v Warning | tee "$OUT/e2e-f16.txt"
