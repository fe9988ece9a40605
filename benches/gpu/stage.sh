#!/usr/bin/env bash
# Builds the GPU bench here (no GPU needed) and stages it with its scripts in .gpu/, next
# to what ../shared/gpu/stage staged (run that first: it recreates .gpu/).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
cargo build --release -p attnstore-benches --features cuda --bin gpu_decode --bin gpu_tiered --bin gpu_wave --bin gpu_hack --bin gpu_engine
mkdir -p .gpu
for b in gpu_decode gpu_tiered gpu_wave gpu_hack gpu_engine; do cp "target/release/$b" .gpu/ && strip ".gpu/$b"; done
cp benches/gpu/sdpa.py benches/gpu/compare.py .gpu/
cp benches/gpu/run.sh .gpu/bench.sh
cp benches/gpu/hack.sh .gpu/hack.sh
cp benches/gpu/batch.sh .gpu/batch.sh
cp benches/gpu/profile.sh benches/gpu/ncu_detail.sh benches/gpu/ab.sh .gpu/
du -sh .gpu
