"""Teacher-forced accuracy of attnstore's sparse decode plans inside transformers.

A real model from `scripts/fetch-model` (loaded through transformers' GGUF support, float32
weights) summarizes a text of `--length` prompt tokens: `--model smollm2` (SmolLM2-135M-
Instruct, its prompt built as the Rust runtime's `attnstore eval` builds it: same system
prompt, text and suffix) or `--model gemma3` (Gemma-3-270M, a base model: "Text: ...
Summary:"; its sliding-window layers stay with transformers, its global layers are served by
attnstore). The prompt is prefilled once, in chunks, by transformers' SDPA; the reference is
SDPA's greedy continuation of `--tokens` tokens; attnstore caches are filled with the same
prompt KV, and the default sparse plan (`attnstore.hf.model_budget()`, or `--scale`d) is fed
the reference tokens (teacher forcing) and compared position by position: top-1 agreement,
mean KL(exact || sparse), near ties (exact's two best tokens within 0.05 probability). Also
the free-running greedy agreement, and the plan of one served layer (EXPLAIN).

    target/pyenv/bin/python python/examples/hf_eval.py --length 8128 [--text runtime/data/hack.txt]
    target/pyenv/bin/python python/examples/hf_eval.py --model gemma3 --length 32768 \
        --text runtime/data/retroinfer.txt --text runtime/data/hack.txt
"""

import argparse
import json
import pathlib
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import attnstore
import attnstore.hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n"
)


MODELS = {
    "smollm2": (
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        f"{SYSTEM}Summarize the following text in a few sentences.\n\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    ),
    "gemma3": ("gemma-3-270m-q4_k_m.gguf", "Text:\n\n", "\n\nA summary of the text in a few sentences:"),
}


def prompt(tok, model, text, length):
    """prefix + the text's first tokens + suffix, exactly `length` tokens."""
    _, head, tail = MODELS[model]
    prefix = tok.encode(head)  # with the tokenizer's own start tokens (Gemma's <bos>)
    suffix = tok.encode(tail, add_special_tokens=False)
    body = tok.encode(text, add_special_tokens=False)
    n = length - len(prefix) - len(suffix)
    if not 0 <= n <= len(body):
        raise SystemExit(f"a prompt of {length} tokens needs {n} tokens of text; the text has {len(body)}")
    return torch.tensor([prefix + body[:n] + suffix])


def prefill(model, ids, chunk, progress=False):
    """SDPA's prefill of `ids` in chunks into a cache that keeps every layer's KV: the last
    position's logits and each layer's prompt (keys, values), which later decode steps leave
    as they are (they concatenate into new tensors)."""
    model.set_attn_implementation("sdpa")
    t = time.time()
    cache = DynamicCache()
    for at in range(0, ids.shape[1], chunk):
        out = model(ids[:, at : at + chunk], past_key_values=cache, logits_to_keep=1)
        if progress:
            print(f"prefill {min(at + chunk, ids.shape[1])} / {ids.shape[1]} tokens, {time.time() - t:.0f} s", flush=True)
    return out.logits[0, -1].float(), cache, [(layer.keys, layer.values) for layer in cache.layers]


def filled_cache(model, prompt_kv, **options):
    """An `attnstore.hf` cache holding `prompt_kv` (what `prefill` returned)."""
    c = attnstore.hf.cache_for(model, **options)
    for i, (k, v) in enumerate(prompt_kv):
        c.layers[i].update(k, v)
    return c


def step(model, cache, token):
    return model(torch.tensor([[token]]), past_key_values=cache).logits[0, -1].float()


def load(args):
    """The model (float32 weights, gradients off) and the prompt of `args.length` tokens
    over `args.text` (default: the RetroInfer paper); returns (model, ids, text paths)."""
    name = MODELS[args.model][0]
    texts = args.text or [str(ROOT / "runtime/data/retroinfer.txt")]
    tok = AutoTokenizer.from_pretrained(ROOT / "models", gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models", gguf_file=name, dtype=torch.float32).eval()
    ids = prompt(tok, args.model, "\n\n".join(pathlib.Path(t).read_text() for t in texts), args.length)
    torch.set_grad_enabled(False)
    return model, ids, texts


def greedy_reference(model, ids, chunk, tokens):
    """One chunked SDPA prefill, then SDPA's greedy continuation of `tokens` tokens: returns
    the logits of each position, the tokens, the prompt's KV per layer and SDPA's time per
    decode step (seconds)."""
    first, cache, prompt_kv = prefill(model, ids, chunk, progress=True)
    logits, reference = [first], [int(first.argmax())]
    t = time.time()
    while len(reference) < tokens:
        logits.append(step(model, cache, reference[-1]))
        reference.append(int(logits[-1].argmax()))
    return logits, reference, prompt_kv, (time.time() - t) / max(tokens - 1, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--text", action="append", help="text file(s), joined (default: the RetroInfer paper)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--scale", type=float, default=1.0, help="scales the budget's floor and retrieved share")
    ap.add_argument("--method", default="wave")
    ap.add_argument("--codec", help="codec of the engine's rows (hack2, hack2c, kv43; default f16/f32 rows)")
    ap.add_argument("--exact", action="store_true", help="plan every step exactly (with --codec: exact over the 2-bit rows)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model, ids, texts = load(args)
    logits, reference, prompt_kv, sdpa_step = greedy_reference(model, ids, args.chunk, args.tokens)

    budget = attnstore.hf.model_budget(args.scale)

    explained = []

    def run(teacher):
        c = filled_cache(model, prompt_kv, method=args.method, budget=budget, codec=args.codec, exact=args.exact)
        out, toks = [logits[0]], [reference[0]]
        t = time.time()
        while len(toks) < args.tokens:
            prev = reference[len(toks) - 1] if teacher else toks[-1]
            out.append(step(model, c, prev))
            toks.append(int(out[-1].argmax()))
        per = (time.time() - t) / (args.tokens - 1)
        if not explained:
            layer = c.served_layers()[-1]
            q = torch.zeros(c.q_heads, c.head_dim).numpy()
            explained.append(c.engine.plan(c.contexts[0], layer, q, budget=budget).explain())
        c.close()
        return out, toks, per

    got, _, attn_step = run(teacher=True)
    top1 = kl = ties = decisive = 0
    for i in range(1, args.tokens):
        p = logits[i].log_softmax(-1)
        q = got[i].log_softmax(-1)
        hit = int(got[i].argmax()) == reference[i]
        top1 += hit
        kl += float(torch.sum(p.exp() * (p - q)))
        two = p.exp().topk(2).values
        if float(two[0] - two[1]) < 0.05:
            ties += 1
        else:
            decisive += hit
    _, own, _ = run(teacher=False)
    positions = args.tokens - 1
    row = {
        "length": int(ids.shape[1]),
        "model": args.model,
        "text": "+".join(pathlib.Path(t).stem for t in texts),
        "method": "exact" if args.exact else args.method,
        "codec": args.codec or "plain",
        "budget_scale": args.scale,
        "teacher_top1": top1 / positions,
        "kl": kl / positions,
        "near_ties": ties,
        "teacher_top1_decisive": decisive / max(positions - ties, 1),
        "free_agreement": sum(a == b for a, b in zip(own, reference)) / len(reference),
        "sdpa_step_ms": sdpa_step * 1e3,
        "attnstore_step_ms": attn_step * 1e3,
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in row.items()))
    print(explained[0], file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    main()
