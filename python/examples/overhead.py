"""What a decode step costs through Python beyond the same step in Rust.

One layer of one context (Llama-3.1-8B's attention shape by default: 32 q / 8 kv heads,
d = 128, f16 rows) holds `--tokens` random tokens. Each round times `--iters` calls of
`Engine.attend_many` from Python (a NumPy query, and a torch one through DLPack; the output
comes back as a NumPy array) and `--iters` calls of the very same plan + execute inside Rust
(`Engine.time_steps`, the baseline, same process, same data), and reports the medians and
their difference: the boundary's cost per layer. `--gpu` runs both on the GPU executor
(a `cuda` build and a GPU), and adds a third Python call: the query a CUDA tensor read in
place and the output written into a CUDA tensor (`out=`; nothing crosses to the host).
Rounds alternate; min / median / max over rounds are printed.

    target/pyenv/bin/python python/examples/overhead.py [--tokens 32768] [--gpu]
"""

import argparse
import json
import statistics
import time

import numpy as np

import attnstore


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h, kv, d, n = args.q_heads, args.kv_heads, args.head_dim, args.tokens
    rows = kv * n * d * 2 * 2
    engine = attnstore.Engine(host_blocks=rows // 2048 * 2 + 1024, gpu=args.gpu) if args.gpu else attnstore.Engine()
    ctx = engine.create_context(q_heads=h, kv_heads=kv, head_dim=d, layers=1, dtype="f16")
    rng = np.random.default_rng(11)
    k = rng.standard_normal((kv, n, d), dtype=np.float32)
    v = rng.standard_normal((kv, n, d), dtype=np.float32)
    engine.prefill(ctx, 0, k, v)
    q = (2.0 * k[np.arange(h) // (h // kv), rng.integers(0, n, h)]).reshape(1, h, d).astype(np.float32)
    try:
        import torch

        qt = torch.from_numpy(q.copy())
        qc = qt.cuda() if args.gpu else None
        out = torch.empty_like(qc) if args.gpu else None
    except ImportError:
        qt = qc = out = None
    kw = {"exact": True} if args.exact else {}
    for _ in range(10):  # warm up (the GPU copies the layer at its first step)
        engine.attend_many([ctx], 0, q, **kw)

    ctxs = [ctx]

    def py_median(query, **extra):
        # The call's arguments are made once, outside the timed span: building them is the
        # caller's cost, not the boundary's.
        call_kw = {**kw, **extra}
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            engine.attend_many(ctxs, 0, query, **call_kw)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    added, added_torch, added_cuda, rust_us, py_us = [], [], [], [], []
    for _ in range(args.rounds):
        rust = statistics.median(engine.time_steps([ctx], 0, q, args.iters, **kw))
        py = py_median(q)
        rust_us.append(rust * 1e6)
        py_us.append(py * 1e6)
        added.append((py - rust) * 1e6)
        if qt is not None:
            added_torch.append((py_median(qt) - rust) * 1e6)
        if qc is not None:
            added_cuda.append((py_median(qc, out=out) - rust) * 1e6)

    def mmm(xs):
        return [round(min(xs), 2), round(statistics.median(xs), 2), round(max(xs), 2)] if xs else None

    row = {
        "tokens": n,
        "device": "gpu" if args.gpu else "cpu",
        "plan": "exact" if args.exact else "sparse",
        "rust_step_us": mmm(rust_us),
        "python_step_us": mmm(py_us),
        "added_us_numpy": mmm(added),
        "added_us_torch": mmm(added_torch),
        "added_us_cuda_in_place": mmm(added_cuda),
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k:>16}: {v}  (min / median / max)" for k, v in row.items()))


if __name__ == "__main__":
    main()
