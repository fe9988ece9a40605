#!/usr/bin/env bash
# GPU tests of the new build, then gpu_engine old/new alternating (128K x3 pairs, 512K x1).
cd "$(dirname "$0")/.."
bash .gpu/run.sh tests 2>&1 | grep -E "^==|test result|FAILED|panicked|fail=|skip"
bash .gpu/run.sh bench old:131072 new:131072 old:131072 new:131072 old:131072 new:131072 old:524288 new:524288 2>&1 | grep -v "^NVIDIA"
tar -C "$OUT" -czf "$OUT/gpu_results.tgz" --exclude gpu_results.tgz . 2>/dev/null; ls -la $OUT
