#!/usr/bin/env bash
# On the GPU machine: installs the carried cuda wheel (.gpu/*.whl, built with
# `maturin build --release --features cuda`), then runs the steps named in $STEPS:
# tests (pytest with ATTNSTORE_GPU=1), overhead (python/examples/overhead.py --gpu),
# overhead-cpu (the same on the CPU executor),
# bench (python/examples/hf_gpu_bench.py with $BENCH_ARGS). Results go to $OUT.
set -uo pipefail
rm -rf .pysite && python3 -m pip install -q --no-index --no-deps --target .pysite .gpu/*.whl || exit 1
export PYTHONPATH=$PWD/.pysite LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} ATTNSTORE_GPU=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
for step in ${STEPS:-tests overhead bench}; do
  echo "== $step"
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider python/tests -k "gpu or sdpa or attend_many" 2>&1 | tail -15 ;;
    overhead)
      for n in 32768 131072; do python3 python/examples/overhead.py --gpu --tokens $n --json | tee -a "$OUT/overhead.jsonl"; done ;;
    overhead-cpu)
      for n in 32768 131072; do python3 python/examples/overhead.py --tokens $n --json | tee -a "$OUT/overhead.jsonl"; done ;;
    bench) python3 python/examples/hf_gpu_bench.py ${BENCH_ARGS:-} --json-out "$OUT/bench-$(date +%s).json" 2>&1 | grep -v Warning ;;
  esac
done
