"""PyTorch baselines on the GPU machine, same shapes as gpu_decode: SDPA decode (batch 1,
32 q heads / 8 kv heads, d=128, f16, all KV in HBM) and the sparse plan written in plain
PyTorch (gather the plan's rows, then SDPA over them), and the whole tripartite wave step in
plain PyTorch (`tripartite`), timed with CUDA events (median of 30); at 128K also SDPA at
batch 4 and SDPA's causal prefill of the layer (median of 5), the index build's yardstick.
Prints JSON lines like gpu_decode."""
import json
import sys

import torch
import torch.nn.functional as F


def timed(fn, reps=30, warm=5):
    for _ in range(warm):
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


def tripartite(q, k, v, tokens, g):
    """The wave plan of `gpu_wave` written in plain PyTorch, what a user would write instead:
    score every cluster's centroid (group max), top-r clusters per KV head (1.8% of the
    tokens), gather their rows and the steady zone (sink 4 + local 64), attend them exactly,
    estimate every other cluster from (centroid, size, mean value), merge by log-sum-exp.
    Clusters are 16 consecutive rows of a cluster-ordered layout. With KV in HBM, and with KV
    in pinned host memory (rows gathered on the CPU, then copied)."""
    dev, per = "cuda", 16
    n = (tokens - 68) // per
    r = -(-int(tokens * 0.018) // per)
    scale = 128 ** -0.5
    qg = q.view(8, 4, 128).float()
    cent = torch.randn(8, n, 128, device=dev, dtype=torch.float16, generator=g)
    vmean = torch.randn(8, n, 128, device=dev, dtype=torch.float16, generator=g)
    log_size = torch.full((8, 1, n), float(per), device=dev).log()
    steady = torch.cat([torch.arange(4), torch.arange(tokens - 64, tokens)]).to(dev)
    offs = torch.arange(per, device=dev)
    kk, vv = k[0], v[0]
    kh, vh = kk.cpu().pin_memory(), vv.cpu().pin_memory()

    def step(host):
        s = torch.einsum("hgd,hnd->hgn", qg, cent.float()) * scale
        top = s.amax(1).topk(r, dim=-1).indices
        rows = torch.cat([(top[:, :, None] * per + offs).reshape(8, -1), steady.expand(8, -1)], dim=1)
        if host:
            ix = rows.cpu()[..., None].expand(-1, -1, 128)
            ks = torch.gather(kh, 1, ix).to(dev, non_blocking=True)
            vs = torch.gather(vh, 1, ix).to(dev, non_blocking=True)
        else:
            ix = rows[..., None].expand(-1, -1, 128)
            ks, vs = torch.gather(kk, 1, ix), torch.gather(vv, 1, ix)
        sc = torch.einsum("hgd,hrd->hgr", qg, ks.float()) * scale
        m1 = sc.amax(-1, keepdim=True)
        p1 = (sc - m1).exp()
        l1, o1 = p1.sum(-1, keepdim=True), torch.einsum("hgr,hrd->hgd", p1, vs.float())
        keep = torch.ones(8, n, dtype=torch.bool, device=dev).scatter_(1, top, False)
        se = (s + log_size).masked_fill(~keep[:, None, :], float("-inf"))
        m2 = se.amax(-1, keepdim=True)
        p2 = (se - m2).exp()
        l2, o2 = p2.sum(-1, keepdim=True), torch.einsum("hgn,hnd->hgd", p2, vmean.float())
        m = torch.maximum(m1, m2)
        a, b = (m1 - m).exp(), (m2 - m).exp()
        return (o1 * a + o2 * b) / (l1 * a + l2 * b)

    out = [("torch_tripartite_hbm", timed(lambda: step(False)), 1), ("torch_tripartite_host", timed(lambda: step(True)), 1)]
    del cent, vmean, kh, vh
    return out


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
        rows += tripartite(q, k, v, tokens, g)
        if tokens == 131072:
            # The throughput comparison: SDPA at the largest batch HBM admits (see compare.py).
            kb = torch.randn(4, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            vb = torch.randn(4, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            qb = torch.randn(4, 32, 1, 128, device=dev, dtype=torch.float16, generator=g)
            rows.append(("sdpa_batch4", timed(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)), 4))
            del kb, vb
            # The largest batch this GPU's HBM admits for a 32-layer 8B model: its bf16
            # weights (16.06 GB) and 2 GB of activations, then 16 GiB of f16 KV per sequence.
            total = torch.cuda.mem_get_info()[1]
            per_seq = 32 * tokens * 8 * 128 * 2 * 2
            most = max(1, int((total - 16.06e9 - 2e9) // per_seq))
            kb = torch.randn(most, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            vb = torch.randn(most, 8, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            qb = torch.randn(most, 32, 1, 128, device=dev, dtype=torch.float16, generator=g)
            rows.append(("sdpa_batch_max", timed(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)), most))
            del kb, vb
            # The index build's yardstick: SDPA's causal prefill of the same layer (every
            # query of the context at once), which the build must stay well under (≤ 5%).
            qp = torch.randn(1, 32, tokens, 128, device=dev, dtype=torch.float16, generator=g)
            prefill = timed(lambda: F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True), 5, 1)
            print(json.dumps({"bench": "prefill", "device": "cuda", "method": "sdpa_causal_prefill", "tokens": tokens,
                              "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "f16", "time_us": round(prefill, 2)}))
            del qp
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
