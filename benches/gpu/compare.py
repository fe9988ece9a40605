"""Reads JSON lines of gpu_decode and sdpa.py (files given as arguments) and prints, per
context length, every method's time and its ratio against SDPA measured in the same run."""
import json
import sys

rows = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.startswith("{")]
selects = [r for r in rows if r.get("bench") == "select"]
rows = [r for r in rows if r.get("bench") != "select"]
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
sel = {(r["tokens"], r["method"]): r for r in selects}
print(f"\n{'tokens':>8} {'select':>22} {'attnstore_us':>12} {'torch score+topk':>17} {'torch topk only':>16} {'vs topk':>8}")
for r in selects:
    if r["method"].startswith("torch"):
        continue
    t, m = r["tokens"], r["method"]
    both = sel.get((t, "torch_" + m), {}).get("time_us")
    only = sel.get((t, "torch_topk_only_" + m.split("_")[-1]), {}).get("time_us")
    ratio = f"{only / r['time_us']:.2f}x" if only else "-"
    print(f"{t:>8} {m:>22} {r['time_us']:>12.1f} {both or '-':>17} {only or '-':>16} {ratio:>8}")
    r["baseline"], r["baseline_time_us"] = "torch_topk_only", only
    if only:
        r["speedup"] = round(only / r["time_us"], 3)
rows += selects
print("JSON lines:")
for r in rows:
    print(json.dumps(r))
