#!/usr/bin/env bash
# Builds the GPU bench here (no GPU needed) and stages it with its scripts in .gpu/, next
# to what ../shared/gpu/stage staged (run that first: it recreates .gpu/).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
cargo build --release -p attnstore-benches --features cuda --bin gpu_decode
mkdir -p .gpu
cp target/release/gpu_decode .gpu/ && strip .gpu/gpu_decode
cp benches/gpu/sdpa.py benches/gpu/compare.py .gpu/
cp benches/gpu/run.sh .gpu/bench.sh
du -sh .gpu
