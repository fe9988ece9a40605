#!/usr/bin/env bash
# Stages this machine's `perf` for the GPU machine's host CPU (which has none): the binary,
# its shared libraries and the dynamic loader in .gpu/perf/, with .gpu/perf/run as the
# command (it starts perf through the staged loader, so the host's own libraries do not
# matter). The CPU binaries to profile go in .gpu/cpu/, stripped of debug info only
# (`strip --strip-debug`: symbols stay, so reports name functions; `perf annotate` here,
# with the unstripped binary in target/ and `perf buildid-cache -a`, shows instructions).
#
# On the host only software events work (no PMU in its VM): record with `-e cpu-clock`.
#   bash benches/gpu/perf-stage.sh
#   (device) .gpu/perf/run record -e cpu-clock -F 499 -D 9000 -o $OUT/x.data .gpu/cpu/profile_wave
#   (here)   .gpu/perf/run report -i <files_at>/x.data --stdio --no-children --sort dso,symbol
#   (call graphs: a build with RUSTFLAGS="-C force-frame-pointers=yes -C target-cpu=x86-64-v3",
#    `record -g`, then `perf script > s.txt; python3 benches/gpu/perf_stacks.py s.txt`)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
perf=$(command -v perf)
mkdir -p "$root/.gpu/perf/lib" "$root/.gpu/cpu"
cp -L "$perf" "$root/.gpu/perf/perf"
ldd "$perf" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do cp -L "$lib" "$root/.gpu/perf/lib/"; done
cp -L /lib64/ld-linux-x86-64.so.2 "$root/.gpu/perf/"
cat > "$root/.gpu/perf/run" <<'RUN'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
exec "$here/ld-linux-x86-64.so.2" --library-path "$here/lib" "$here/perf" "$@"
RUN
chmod +x "$root/.gpu/perf/run"
du -sh "$root/.gpu/perf"
