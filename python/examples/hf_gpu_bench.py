"""Decode throughput of a transformers model on the GPU: attnstore against transformers' SDPA.

A model of Llama-3.1-8B's shape (32 layers, 32 q / 8 kv heads, d = 128, bf16; random
weights from its config: speed does not depend on their values) decodes `--steps` tokens
after a context of `--contexts` tokens:

- **attnstore**: `attnstore.hf.AttnstoreCache` over an `Engine(gpu=True)`, the KV homed in
  pinned host memory (the buffer manager's arena) with a 5% GPU tier; each layer's decode
  attention is one `attend_many` (device-planned step).
- **SDPA**: transformers' SDPA attention with the whole KV in HBM, in both of transformers'
  caches: `StaticCache` (preallocated; SDPA gets a mask over its whole length, so no flash
  kernel) and `DynamicCache` (no mask, but every step concatenates each layer's KV anew).
  The ratio is taken against the faster of the two in each round.

The context's KV is random (bf16 Gaussians) and ingested through each cache's own update
path (attnstore: `Engine.prefill`, clustering on the GPU); prefill's own attention is not
timed. Reported per context and batch: ms per decode step, tokens/s and their ratio, rounds
alternating between the two (`--rounds`, min / median / max), and where attnstore's step time
goes (`AttnstoreCache.seconds`: appends, engine steps, waiting for the GPU's queue and copies).

    python3 python/examples/hf_gpu_bench.py --contexts 32768,131072 --batch 1
    python3 python/examples/hf_gpu_bench.py --contexts 131072 --batch 12 --sdpa-batch 3 --codec hack2 --host-gib 90
"""

import argparse
import gc
import json
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import attnstore
import attnstore.hf

BLOCK = 2048


def llama_8b(layers):
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072 + 4096,
        rope_theta=500000.0,
        attn_implementation="sdpa",
    )


def fill(cache, cfg, batch, tokens, seed):
    """Random bf16 KV of `tokens` tokens into every layer of `cache` through its update."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, cfg.num_key_value_heads, tokens, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        cache.layers[i].update(k, v)
        del k, v


def decode(model, cache, batch, steps):
    """Seconds per decode step of `batch` sequences (greedy), after one warm-up step."""
    tok = torch.zeros((batch, 1), dtype=torch.long, device="cuda")
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        tok = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch", type=int, default=1, help="attnstore's batch")
    ap.add_argument("--sdpa-batch", type=int, default=None, help="SDPA's batch (default: --batch)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--gpu-share", default="0.05", help="GPU tier sizes to run, as shares of the Host arena")
    ap.add_argument(
        "--sdpa-cache",
        default="both",
        choices=["both", "static", "dynamic"],
        help="SDPA's caches to fill and time (both hold the batch's KV in HBM at once: one alone fits a larger batch)",
    )
    ap.add_argument("--codec", default=None, help="attnstore's row codec (e.g. hack2: 2-bit rows, a larger batch fits)")
    ap.add_argument(
        "--host-gib",
        type=float,
        default=None,
        help="attnstore's pinned Host arena in GiB (default: f16 rows of the batch, x1.6 for clusters rounding blocks up)",
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    sdpa_batch = args.sdpa_batch or args.batch
    cfg = llama_8b(args.layers)
    torch.set_grad_enabled(False)
    t = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {time.time() - t:.1f} s", flush=True)
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        model.set_attn_implementation("sdpa")
        shares = [float(x) for x in args.gpu_share.split(",")]
        # Every round decodes steps + 1 tokens into it, for every Gpu-tier size.
        static = dynamic = None
        if args.sdpa_cache in ("both", "static"):
            static = StaticCache(config=cfg, max_cache_len=n + (args.steps + 1) * args.rounds * len(shares) + 8)
            fill(static, cfg, sdpa_batch, n, seed=1)
        if args.sdpa_cache in ("both", "dynamic"):
            dynamic = DynamicCache(config=cfg)
            fill(dynamic, cfg, sdpa_batch, n, seed=1)
        print(f"{n} tokens: SDPA caches filled, {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU", flush=True)
        for share in shares:
            rows.append(compare(args, model, cfg, n, share, sdpa_batch, static, dynamic))
        del static, dynamic
        gc.collect()
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


def finite(x):
    """`x`, or None for a cache that was not timed (infinite)."""
    return x if x != float("inf") else None


def compare(args, model, cfg, n, share, sdpa_batch, static, dynamic):
    """attnstore with a Gpu tier of `share` of its arena against both SDPA caches, in rounds."""
    # attnstore: KV in pinned host memory. f16 rows of K and V, clusters rounding blocks up.
    per_layer = cfg.num_key_value_heads * (n + args.steps * (args.rounds + 2) + 64) * cfg.head_dim * 2 * 2
    host_blocks = int(per_layer * 1.6 / BLOCK) * cfg.num_hidden_layers * args.batch + 4096
    if args.host_gib is not None:
        host_blocks = int(args.host_gib * 2**30 / BLOCK)
    t = time.time()
    engine = attnstore.Engine(host_blocks=host_blocks, gpu_blocks=int(host_blocks * share), gpu=True)
    made = time.time() - t
    ours = attnstore.hf.cache_for(model, engine, codec=args.codec)
    fill(ours, cfg, args.batch, n, seed=1)
    ingest = time.time() - t
    print(f"{n} tokens: attnstore ingest of batch {args.batch}: {ingest:.1f} s (engine and its "
          f"{host_blocks * BLOCK / 2**30:.1f} GiB arena {made:.1f} s, Engine.prefill and staging "
          f"{ours.seconds['prefill']:.1f} s; codec {args.codec or 'none'}, Gpu tier {share:.0%})", flush=True)
    ratios, a_ms, s_ms, split, both, hits = [], [], [], [], [], []
    for r in range(args.rounds):
        model.set_attn_implementation("sdpa")
        st = statistics.median(decode(model, static, sdpa_batch, args.steps)) if static is not None else float("inf")
        dy = statistics.median(decode(model, dynamic, sdpa_batch, args.steps)) if dynamic is not None else float("inf")
        both.append((st * 1e3, dy * 1e3))
        s = min(st, dy)
        model.set_attn_implementation(attnstore.hf.NAME)
        before = dict(ours.seconds)
        g0 = engine.gpu_stats()
        a_times = decode(model, ours, args.batch, args.steps)
        g1 = engine.gpu_stats()
        clusters = g1["device_clusters"] - g0["device_clusters"]
        hits.append(1 - (g1["device_missed"] - g0["device_missed"]) / max(clusters, 1))
        a = statistics.median(a_times)
        spent = {k: (ours.seconds[k] - before.get(k, 0.0)) / (args.steps + 1) * 1e3 for k in ours.seconds}
        split.append(spent)
        ratios.append((args.batch / a) / (sdpa_batch / s))
        a_ms.append(a * 1e3)
        s_ms.append(s * 1e3)
        print(f"  round {r}: attnstore {a * 1e3:.2f} ms/step (batch {args.batch}), SDPA static {st * 1e3:.2f} / "
              f"dynamic {dy * 1e3:.2f} ms/step "
              f"(batch {sdpa_batch}), throughput ratio {ratios[-1]:.2f}, Gpu-tier hits {hits[-1]:.1%}; by part (ms/step): "
              + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()), flush=True)
    row = {
        "context": n,
        "gpu_share": share,
        "gpu_hit_ratio": statistics.median(hits),
        "batch": args.batch,
        "sdpa_batch": sdpa_batch,
        "attnstore_ms": [min(a_ms), statistics.median(a_ms), max(a_ms)],
        "sdpa_ms": [min(s_ms), statistics.median(s_ms), max(s_ms)],
        "sdpa_static_ms": finite(statistics.median(b[0] for b in both)),
        "sdpa_dynamic_ms": finite(statistics.median(b[1] for b in both)),
        "ratio": [min(ratios), statistics.median(ratios), max(ratios)],
        "attnstore_tokens_per_s": args.batch / (statistics.median(a_ms) / 1e3),
        "sdpa_tokens_per_s": sdpa_batch / (statistics.median(s_ms) / 1e3),
        "attnstore_parts_ms": {k: statistics.median(p[k] for p in split) for k in split[0]},
        "ingest_s": ingest,
        "engine_s": made,
        "prefill_s": ours.seconds["prefill"],
        "codec": args.codec,
        "host_gib": host_blocks * BLOCK / 2**30,
    }
    print(json.dumps(row), flush=True)
    ours.close()
    del ours, engine
    gc.collect()
    return row


if __name__ == "__main__":
    main()
