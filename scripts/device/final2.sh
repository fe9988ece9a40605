#!/usr/bin/env bash
cd "$(dirname "$0")/.."
bash .gpu/run.sh bench new:131072 old:131072 new:131072 old:131072 2>&1 | grep -v "^NVIDIA"
bash .gpu/cpu/run.sh
