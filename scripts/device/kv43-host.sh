#!/usr/bin/env bash
# Session 56: exact kv43 against f16 exact on the device machine's 16-core host (issue 43's
# CPU goal, >= 3x). Stage: copy into .gpu/ the CLI and probes of this build (attnstore,
# probe_kv43, probe_kv43_stream) and of the build compared against (attnstore_base,
# probe_kv43_base; session 56 used e0dcbdf, session 55's last), all stripped; carry .gpu and
# run `bash .gpu/kv43-host.sh`. The engine's ratio first (the goal), then the probes. Prints everything; nothing is written under $OUT.
# ATTNSTORE_KV43_PREFETCH=N[,t0|t1|t2|nta][,burst] picks the decode's prefetch (default 4
# blocks ahead into L2, spread over the kernels; `burst` is the session-55 way, 0 none).
set -u
G=.gpu
lscpu | grep -E 'Model name|L2|L3|NUMA|Socket|^CPU\(s\)' | cut -c1-90
cat /sys/kernel/mm/transparent_hugepage/enabled
echo "== engine, 128K, exact over kv43 vs f16 exact (same run), base and new alternated"
B="bench --tokens 128K --codec kv43 --method wave --selection per-kv-head --estimate 0.232 --queries 3 --reps 5 --json"
for i in 1 2; do
  for b in attnstore_base attnstore; do
    bin=${b%%:*}; pf=${b#*:}; [ "$pf" = "$b" ] && pf=4
    echo -n "$b $i: "
    ATTNSTORE_KV43_PREFETCH=$pf timeout 150 $G/$bin $B 2>/dev/null \
      | grep -E '"method":"(exact|exact_hack2|wave)"' | grep -o '"method":"[a-z_0-9]*"\|"time_us":[0-9.]*\|"speedup":[0-9.]*' | tr '\n' ' '
    echo
  done
done
echo "== in cache (32K rows, one thread): base, new"
for i in 1; do
  PROBE_KV43_HEADS_ONLY=200 $G/probe_kv43_base 32768; PROBE_KV43_HEADS_ONLY=200 $G/probe_kv43 32768
done
echo "== one thread 512K rows (64 MB, may sit in L3), then 16 threads x 131072 rows, by prefetch"
for pf in 4 "4,burst" 0; do
  echo "-- prefetch $pf"
  ATTNSTORE_KV43_PREFETCH=$pf PROBE_KV43_HEADS_ONLY=10 $G/probe_kv43 524288
  ATTNSTORE_KV43_PREFETCH=$pf $G/probe_kv43 131072 16 | tail -1
done
echo "-- base build"; $G/probe_kv43_base 131072 16 | tail -1
echo "== thread scaling, new build: 1 2 4 8 16"
for t in 1 2 4 8 16; do echo -n "T=$t "; $G/probe_kv43 131072 $t | tail -1; done
echo "== memory pattern: five arrays in per-block pieces (split) vs one stream (joined)"
for pf in 0 4; do for spin in 0 300; do
  ATTNSTORE_KV43_PREFETCH=$pf $G/probe_kv43_stream 1048576 1 $spin
  ATTNSTORE_KV43_PREFETCH=$pf $G/probe_kv43_stream 262144 16 $spin
done; done
