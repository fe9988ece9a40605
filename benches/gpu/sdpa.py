"""PyTorch baselines on the GPU machine, same shapes as gpu_decode: SDPA decode (batch 1,
32 q heads / 8 kv heads, d=128, f16, all KV in HBM) and the sparse plan written in plain
PyTorch (gather the plan's rows, then SDPA over them), timed with CUDA events (median of 30).
Prints JSON lines like gpu_decode."""
import json
import sys

import torch
import torch.nn.functional as F


def timed(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    out.sort()
    return out[len(out) // 2]


def main():
    tokens_list = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "32768,131072,524288").split(",")]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for tokens in tokens_list:
        k = torch.randn(1, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
        v = torch.randn(1, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
        q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.float16, generator=g)
        sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        retrieve = int(tokens * 0.018 + 0.999)
        idx = torch.cat([torch.arange(4, device=dev), torch.arange(tokens - 64, tokens, device=dev),
                         torch.randint(4, tokens - 100, (retrieve,), device=dev, generator=g)])

        def sparse():
            ks, vs = k.index_select(2, idx), v.index_select(2, idx)
            return F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)

        torch_sparse = timed(sparse)
        rows = [("sdpa", sdpa, 1), ("torch_sparse_hbm", torch_sparse, 1)]
        if tokens == 131072:
            # The throughput comparison: SDPA at the largest batch HBM admits (see compare.py).
            kb = torch.randn(4, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            vb = torch.randn(4, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            qb = torch.randn(4, 32, 1, 128, device=dev, dtype=torch.float16, generator=g)
            rows.append(("sdpa_batch4", timed(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)), 4))
            del kb, vb
        for method, us, batch in rows:
            print(json.dumps({"bench": "decode", "device": "cuda", "method": method, "tokens": tokens, "batch": batch,
                              "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "f16",
                              "time_us": round(us, 2)}))
        # Scoring + top-k in plain PyTorch on the same sizes as gpu_decode's select rows.
        qg = q.view(8, 4, 128)
        for what, n, r in [("score_select_clusters", tokens // 16, -(-int(tokens * 0.018) // 16)),
                           ("score_select_tokens", tokens, int(tokens * 0.018 + 0.999))]:
            cent = torch.randn(8, n, 128, device=dev, dtype=torch.float16, generator=g)
            scores = torch.einsum("hgd,hnd->hgn", qg, cent).amax(dim=1).float()
            both = timed(lambda: torch.topk(torch.einsum("hgd,hnd->hgn", qg, cent).amax(dim=1), r, dim=-1))
            only = timed(lambda: torch.topk(scores, r, dim=-1))
            for method, us in [("torch_" + what, both), ("torch_topk_only_" + what.split("_")[-1], only)]:
                print(json.dumps({"bench": "select", "device": "cuda", "method": method, "tokens": tokens,
                                  "scored_per_head": n, "r": r, "time_us": round(us, 2)}))
            del cent, scores
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
