"""Reads JSON lines of gpu_decode and sdpa.py (files given as arguments) and prints, per
context length, every method's time and its ratio against SDPA measured in the same run."""
import json
import sys

rows = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.startswith("{")]
by = {}
for r in rows:
    by.setdefault(r["tokens"], {})[r["method"]] = r
print(f"{'tokens':>8} {'method':>22} {'time_us':>9} {'vs sdpa':>8} {'GB/s':>7} {'hit':>6}")
for tokens in sorted(by):
    base = by[tokens].get("sdpa", {}).get("time_us")
    for method, r in by[tokens].items():
        ratio = f"{base / r['time_us']:.2f}x" if base else "-"
        print(f"{tokens:>8} {method:>22} {r['time_us']:>9.1f} {ratio:>8} {r.get('gbps', '-'):>7} {r.get('hit_ratio', '-'):>6}")
        r["baseline"], r["baseline_time_us"] = "sdpa", base
        if base:
            r["speedup"] = round(base / r["time_us"], 3)
print("JSON lines:")
for r in rows:
    print(json.dumps(r))
