"""Where a long prompt's ingest goes: one sequence of Llama-3.1-8B's KV shape into attnstore.

`python/examples/hf_gpu_bench.py` measured ~114 s to ingest one 128K-token sequence of 32
layers through `attnstore.hf` on the GPU machine, against 0.6–0.9 s per layer for
`Engine::prefill_gpu` alone in Rust. This script splits the Python path into its parts, per
layer, with random bf16 KV made on the device as the bench makes it (on the CPU where torch has
no CUDA, with `--cpu`):

- `engine`: creating the `Engine` (its pinned Host arena sized as the bench sizes it);
- `to_host`: the layer's keys and values from the device to host memory as `attnstore.hf`
  does (`staged`: bf16 into pinned buffers kept between layers), and the alternatives
  `--to-host` names (`f32`: new float32 NumPy arrays, as it did before);
- `prefill`: `Engine.prefill` (the clustering on the GPU where the engine has it).

    python3 python/examples/ingest_profile.py --tokens 131072 --layers 8 [--cpu] [--json]
"""

import argparse
import json
import statistics
import time
import types

import torch

import attnstore
import attnstore.hf

BLOCK = 2048


def to_host_variants():
    holder = types.SimpleNamespace(_staging=[None, None])
    return {
        # attnstore.hf's prompt path: the device rows copied as they are (bf16) into pinned
        # staging kept between layers; the engine widens them.
        "staged_k": lambda t: attnstore.hf.AttnstoreCache._staged(holder, t, 0),
        "staged_v": lambda t: attnstore.hf.AttnstoreCache._staged(holder, t, 1),
        # attnstore.hf's conversion before session 58 (still its decode path): float32 NumPy
        # rows in new memory, torch picks where the dtype changes.
        "f32": attnstore.hf._rows,
        # Widen on the device, then one device-to-host copy of float32.
        "widen_then_copy": lambda t: t.float().cpu().numpy(),
        # Copy bf16 (half the bytes) to the host, widen there.
        "copy_then_widen": lambda t: t.cpu().float().numpy(),
        # bf16 to the host only (Engine.prefill reads bf16 through DLPack and widens itself).
        "bf16": lambda t: t.cpu(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context-layers", type=int, default=32, help="layers the arena is sized for (the bench's)")
    ap.add_argument("--cpu", action="store_true", help="an Engine without the GPU (clustering on the CPU)")
    ap.add_argument(
        "--to-host",
        default="staged,f32",
        help="comma-separated, the first one prefilled: staged (attnstore.hf's), f32, widen_then_copy, copy_then_widen, bf16",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kv, d, n = args.kv_heads, args.head_dim, args.tokens
    variants = to_host_variants()
    names = args.to_host.split(",")
    for name in names:
        if name not in variants and name != "staged":
            raise SystemExit(f"--to-host {name!r}: expected one of {', '.join(variants)}")

    per_layer = kv * (n + 64) * d * 2 * 2
    host_blocks = int(per_layer * 1.6 / BLOCK) * args.context_layers + 4096
    t = time.perf_counter()
    if args.cpu:
        engine = attnstore.Engine(host_blocks=host_blocks)
    else:
        engine = attnstore.Engine(host_blocks=host_blocks, gpu_blocks=int(host_blocks * 0.05), gpu=True)
    made = time.perf_counter() - t
    ctx = engine.create_context(q_heads=32, kv_heads=kv, head_dim=d, layers=args.layers, dtype="f16")
    print(f"engine: {made:.2f} s ({host_blocks} blocks of {BLOCK} B, gpu={not args.cpu})", flush=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(1)
    parts = {f"to_host:{name}": [] for name in names}
    parts["prefill"] = []
    for layer in range(args.layers):
        k = torch.randn((kv, n, d), generator=gen, device=device, dtype=torch.bfloat16)
        v = torch.randn((kv, n, d), generator=gen, device=device, dtype=torch.bfloat16)
        if device == "cuda":
            torch.cuda.synchronize()
        rows = None
        for name in names:
            t = time.perf_counter()
            if name == "staged":
                got = (variants["staged_k"](k), variants["staged_v"](v))
            else:
                got = (variants[name](k), variants[name](v))
            parts[f"to_host:{name}"].append(time.perf_counter() - t)
            rows = rows or got  # the first variant's rows are prefilled
        t = time.perf_counter()
        engine.prefill(ctx, layer, *rows)
        parts["prefill"].append(time.perf_counter() - t)
        print(f"layer {layer}: " + ", ".join(f"{p} {s[-1]:.3f} s" for p, s in parts.items()), flush=True)
        del k, v, rows

    row = {
        "bench": "ingest_profile",
        "tokens": n,
        "layers": args.layers,
        "gpu": not args.cpu,
        "engine_s": made,
        "per_layer_s": {p: [min(s), statistics.median(s), max(s)] for p, s in parts.items()},
    }
    if args.json:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
