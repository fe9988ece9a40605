#!/usr/bin/env bash
# On the GPU machine: where a long prompt's ingest goes (issue 39: ~114 s per 128K sequence
# of 32 layers through attnstore.hf). Staging: the cuda wheel in .gpu/ (`maturin build
# --release --features cuda` in python/), `bash benches/gpu/perf-stage.sh` for .gpu/perf.
# Runs python/examples/ingest_profile.py on the GPU engine (per-layer parts and the
# device-to-host alternatives), then under perf (flat profile by DSO and symbol), then on a
# CPU engine (the clustering on the host's cores). Results in $OUT.
set -uo pipefail
rm -rf .pysite && python3 -m pip install -q --no-index --no-deps --target .pysite .gpu/*.whl || exit 1
export PYTHONPATH=$PWD/.pysite LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-6}
nproc; free -g | head -2
echo "== gpu engine, 128K, $LAYERS layers"
python3 python/examples/ingest_profile.py --tokens 131072 --layers "$LAYERS" \
  --to-host staged,f32,widen_then_copy,copy_then_widen --json 2>&1 | tee "$OUT/ingest-gpu.txt"
if [ -x .gpu/perf/run ]; then
  echo "== perf, gpu engine, 128K, 3 layers"
  .gpu/perf/run record -q -e cpu-clock -F 499 -o "$OUT/ingest.data" \
    python3 python/examples/ingest_profile.py --tokens 131072 --layers 3 2>&1 | tail -5
  .gpu/perf/run report -i "$OUT/ingest.data" --stdio --no-children --sort dso,symbol 2>/dev/null \
    | grep -v '^#' | grep -v '^$' | head -70 | tee "$OUT/ingest-perf.txt"
  .gpu/perf/run report -i "$OUT/ingest.data" --stdio --no-children --sort comm,dso 2>/dev/null \
    | grep -v '^#' | grep -v '^$' | head -25 | tee -a "$OUT/ingest-perf.txt"
  rm -f "$OUT/ingest.data"
fi
echo "== cpu engine, 128K, 2 layers"
python3 python/examples/ingest_profile.py --cpu --tokens 131072 --layers 2 --json 2>&1 | tee "$OUT/ingest-cpu.txt"
