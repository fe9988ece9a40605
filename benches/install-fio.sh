#!/usr/bin/env bash
# Installs fio, the baseline of the Disk-tier read benchmark (`buffer_bench disk`).
# Debian/Ubuntu only; the bench falls back to `dd iflag=direct` alone when fio is missing.
set -euo pipefail
if command -v fio >/dev/null; then
    fio --version
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq fio
fio --version
