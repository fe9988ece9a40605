"""Reads JSON lines of gpu_decode and sdpa.py (files given as arguments) and prints, per
context length, every method's time and its ratio against SDPA measured in the same run."""
import json
import sys

rows = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.startswith("{")]
selects = [r for r in rows if r.get("bench") == "select"]
builds = [r for r in rows if r.get("bench") == "index_build"]
prefills = {r["tokens"]: r for r in rows if r.get("bench") == "prefill"}
engine_prefills = [r for r in rows if r.get("bench") == "engine_prefill"]
rows = [r for r in rows if r.get("bench") not in ("select", "index_build", "prefill", "engine_prefill") and "time_us" in r and "method" in r]
by = {}
for r in rows:
    by.setdefault(r["tokens"], {})[r["method"]] = r
print(f"{'tokens':>8} {'method':>22} {'time_us':>9} {'vs sdpa':>8} {'GB/s':>7} {'hit':>6}")
for tokens in sorted(by):
    sdpa1 = by[tokens].get("sdpa", {}).get("time_us")
    for method, r in by[tokens].items():
        base = sdpa1 if r.get("batch", 1) == 1 else None  # batched rows: see the throughput lines
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
# Throughput at 128K for a 32-layer 8B model (BENCH.md / the CUDA issue): SDPA keeps all KV in
# the 64 GiB of HBM left after 16 GiB of weights; attnstore keeps KV in a 100 GiB pinned host
# budget and only the meta index + 5% block cache per context on the GPU. The batched row
# (`wave_batch_host_gpu_tier`) steps all its contexts together; the per-request rows are
# shown as if run one after another (batch x their time).
kv_per_seq = 32 * 131072 * 8 * 128 * 2 * 2
sdpa_b = (64 << 30) // kv_per_seq
ours_b = (100 << 30) // kv_per_seq
sb = by.get(131072, {}).get("sdpa_batch4")
for method in ("sparse_host_gpu_tier", "wave_step_host_gpu_tier", "wave_batch_host_gpu_tier", "engine_device_step",
               "engine_device_step_maintained", "engine_device_batch", "engine_device_batch_maintained"):
    tier = by.get(131072, {}).get(method)
    if not (sb and tier and sdpa_b == 4):
        continue
    sdpa_tps = sdpa_b / (sb["time_us"] * 1e-6)
    if method in ("wave_batch_host_gpu_tier", "engine_device_batch", "engine_device_batch_maintained"):
        batch, step_us = tier["batch"], tier["time_us"]
        how = f"{step_us:.1f} us per batched step"
    else:
        batch, step_us = ours_b, ours_b * tier["time_us"]
        how = f"{ours_b} x {tier['time_us']:.1f} us"
    ours_tps = batch / (step_us * 1e-6)
    print(f"\nthroughput at 128K, per layer: SDPA batch {sdpa_b} ({sb['time_us']:.1f} us/step) -> {sdpa_tps:,.0f} tokens/s; "
          f"attnstore {method} batch {batch} ({how}) -> {ours_tps:,.0f} tokens/s; ratio {ours_tps / sdpa_tps:.2f}x")
    rows.append({"bench": "throughput", "device": "cuda", "tokens": 131072, "method": method,
                 "batch": batch, "tokens_per_s_layer": round(ours_tps), "baseline": "sdpa", "baseline_batch": sdpa_b,
                 "baseline_tokens_per_s_layer": round(sdpa_tps), "speedup": round(ours_tps / sdpa_tps, 3)})
for tokens in sorted(by):
    g, e = by[tokens].get("wave_step_host_gpu_tier"), by[tokens].get("wave_step_host_gpu_tier_eager")
    if g and e:
        print(f"{tokens:>8} wave step from a CUDA graph {g['time_us']:.1f} us (host enqueue {g.get('host_enqueue_us')} us) "
              f"vs kernel by kernel {e['time_us']:.1f} us (host enqueue {e.get('host_enqueue_us')} us)")
for tokens in sorted(by):
    b = by[tokens].get("wave_batch_host_gpu_tier")
    if b and "lanes_wall_us" in b:
        print(f"{tokens:>8} batch of {b['batch']}, host wall from the first launch to the last output: one graph of every "
              f"lane {b['graph_wall_us']:.1f} us vs a graph per request launched on its lane {b['lanes_wall_us']:.1f} us "
              f"({b['graph_wall_us'] / b['lanes_wall_us']:.2f}x)")
for tokens in sorted(by):
    for ours, theirs in (("wave_step_host_gpu_tier", "torch_tripartite_host"), ("wave_step_hbm", "torch_tripartite_hbm")):
        a, b = by[tokens].get(ours), by[tokens].get(theirs)
        if a and b:
            print(f"{tokens:>8} {ours} {a['time_us']:.1f} us vs plain PyTorch {theirs} {b['time_us']:.1f} us: "
                  f"{b['time_us'] / a['time_us']:.2f}x")
for r in builds:
    if r["method"] == "wave_layout_device":
        print(f"\nindex build at {r['tokens']} tokens, all on the device: {r['time_us'] / 1e3:.2f} ms "
              f"({r['iterations']} update steps; {r['no_update_step_us'] / 1e3:.2f} ms with none; the copy to the host "
              f"{r['download_us'] / 1e3:.1f} ms more) vs {r['cpu_threads']} CPU threads "
              f"{r['baseline_time_us'] / 1e6:.2f} s ({r['speedup']:.0f}x)")
    else:
        print(f"\nindex build at {r['tokens']} tokens: GPU k-means {r['time_us'] / 1e6:.2f} s vs {r['cpu_threads']} CPU "
              f"threads {r['baseline_time_us'] / 1e6:.2f} s ({r['speedup']:.1f}x)")
    p = prefills.get(r["tokens"])
    if p:
        r["prefill_time_us"] = p["time_us"]
        r["share_of_prefill"] = round(r["time_us"] / p["time_us"], 4)
        print(f"  vs SDPA causal prefill of the layer {p['time_us'] / 1e3:.1f} ms: the build is "
              f"{100 * r['time_us'] / p['time_us']:.0f}% of it (goal <= 5%)")
for r in engine_prefills:
    print(f"\nengine prefill at {r['tokens']} tokens (f32 KV in host memory to a planned index): clustering on the GPU "
          f"{r['time_us'] / 1e3:.0f} ms (median of {r['runs']}) vs {r['cpu_threads']} CPU threads {r['baseline_time_us'] / 1e3:.0f} ms "
          f"({r['speedup']:.1f}x)")
rows += builds + list(prefills.values()) + engine_prefills
print("JSON lines:")
for r in rows:
    print(json.dumps(r))
