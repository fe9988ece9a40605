"""Time to first token of a transformers model through attnstore's remote tier.

One process-like run prefills a long prompt from scratch with `attnstore.hf.cache_for(model,
remote=tier, prompt=ids)` and publishes it; then `--runs` runs, each with a new engine,
cache and tier (what another process or node has), attach the published prefix and
prefill only the rest. Prints each run's time to first token, the ratio, and whether the
first generated tokens agree. Needs a Redis server (`--url`, default: one started here on a
free port; `scripts/install-redis`), torch and transformers (`scripts/install-torch`) and
SmolLM2 (`scripts/fetch-model`).

    python python/examples/hf_remote_ttft.py --chars 31000 --runs 5
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnstore
import attnstore.hf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def start_redis() -> tuple[subprocess.Popen, str]:
    """A Redis server of its own on a free loopback port."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (scripts/install-redis)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args + ["--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def first_tokens(model, ids, cache, n):
    """(seconds to the first generated token, the first `n` generated tokens)."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=1, do_sample=False
        )
    ttft = time.perf_counter() - start
    with torch.no_grad():
        more = model.generate(out, past_key_values=cache, max_new_tokens=n - 1, do_sample=False)
    return ttft, more[0, ids.shape[1] :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="redis://HOST:PORT or cluster seeds; default: a server started here")
    ap.add_argument("--chars", type=int, default=31000, help="prompt: this many characters of the paper texts")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8, help="tokens generated per run, compared with the scratch run")
    args = ap.parse_args()
    server, url = (None, args.url) if args.url else start_redis()
    try:
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tok = AutoTokenizer.from_pretrained(ROOT / "models", gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(ROOT / "models", gguf_file=gguf, dtype=torch.float32).eval()
        texts = (ROOT.parent / "shared" / "papers" / name for name in ("retroinfer.txt", "pqcache.txt"))
        prompt = "".join(p.read_text() for p in texts)[: args.chars]
        ids = tok(prompt, return_tensors="pt").input_ids
        print(f"hf_remote_ttft: SmolLM2-135M (float32, exact attention), {ids.shape[1]} prompt tokens, {url}")
        identity = attnstore.hf.model_identity(model)
        tier = attnstore.RemoteTier(url)
        cache = attnstore.hf.cache_for(model, remote=tier, prompt=ids, exact=True)
        scratch, want = first_tokens(model, ids, cache, args.tokens)
        assert tier.flush(600), "the publish did not finish"
        print(f"scratch + publish: first token {scratch:.2f} s (reused {cache.reused}); {tier.stats()['bytes_out'] / 1e6:.0f} MB published")
        ratios = []
        for run in range(args.runs):
            fresh = attnstore.RemoteTier(url)
            start = time.perf_counter()
            c = attnstore.hf.cache_for(model, attnstore.Engine(), remote=fresh, prompt=ids, model_id=identity, exact=True)
            attach = time.perf_counter() - start
            ttft, got = first_tokens(model, ids, c, args.tokens)
            total = attach + ttft
            ratios.append(scratch / total)
            print(
                f"run {run}: attach {attach:.2f} s ({c.reused} tokens) + rest and first token {ttft:.2f} s = {total:.2f} s; "
                f"{scratch / total:.1f}x; first {args.tokens} tokens {'equal' if got == want else f'differ: {got} vs {want}'}"
            )
            c.close()
        ratios.sort()
        print(f"scratch / attached time to first token: min {ratios[0]:.1f} / median {ratios[len(ratios) // 2]:.1f} / max {ratios[-1]:.1f}")
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
