"""Teacher-forced accuracy of attnstore's sparse decode plans inside transformers.

SmolLM2-135M-Instruct (`scripts/fetch-model`, loaded through transformers' GGUF support,
float32 weights) summarizes a text of `--length` prompt tokens, built as the Rust runtime's
`attnstore eval` builds it (same system prompt, text and suffix). The reference is
transformers' own SDPA generation of `--tokens` tokens; attnstore's default sparse plan
(`attnstore.hf.model_budget()`, or `--scale`d) is then fed the same tokens (teacher forcing)
and compared position by position: top-1 agreement, mean KL(exact || sparse), near ties
(exact's two best tokens within 0.05 probability). Also the free-running greedy agreement.

    target/pyenv/bin/python python/examples/hf_eval.py --length 8128 [--text runtime/data/hack.txt]
"""

import argparse
import json
import pathlib
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


def prompt(tok, text, length):
    """prefix + the text's first tokens + suffix, exactly `length` tokens."""
    prefix = tok.encode(f"{SYSTEM}Summarize the following text in a few sentences.\n\n")
    suffix = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    body = tok.encode(text)
    n = length - len(prefix) - len(suffix)
    if not 0 <= n <= len(body):
        raise SystemExit(f"a prompt of {length} tokens needs the text to have at least {n} tokens; it has {len(body)}")
    return torch.tensor([prefix + body[:n] + suffix])


def step(model, cache, token):
    return model(torch.tensor([[token]]), past_key_values=cache).logits[0, -1].float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--text", default=str(ROOT / "runtime/data/retroinfer.txt"))
    ap.add_argument("--scale", type=float, default=1.0, help="scales the budget's floor and retrieved share")
    ap.add_argument("--method", default="wave")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(ROOT / "models", gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models", gguf_file=name, dtype=torch.float32).eval()
    ids = prompt(tok, pathlib.Path(args.text).read_text(), args.length)
    torch.set_grad_enabled(False)

    # The reference: transformers' own SDPA, greedy.
    model.set_attn_implementation("sdpa")
    t = time.time()
    cache = DynamicCache(config=model.config)
    logits = [model(ids, past_key_values=cache).logits[0, -1].float()]
    reference = [int(logits[0].argmax())]
    print(f"sdpa prefill of {ids.shape[1]} tokens: {time.time() - t:.1f} s", flush=True)
    t = time.time()
    while len(reference) < args.tokens:
        logits.append(step(model, cache, reference[-1]))
        reference.append(int(logits[-1].argmax()))
    sdpa_step = (time.time() - t) / (args.tokens - 1)

    base = attnstore.hf.model_budget()
    budget = attnstore.Budget(
        retrieve=base.retrieve * args.scale, floor=round(base.floor * args.scale), estimate="rest",
        short_context=base.short_context,
    )

    def run(teacher):
        c = attnstore.hf.cache_for(model, method=args.method, budget=budget)
        first = model(ids, past_key_values=c).logits[0, -1].float()
        out, toks = [first], [int(first.argmax())]
        t = time.time()
        while len(toks) < args.tokens:
            prev = reference[len(toks) - 1] if teacher else toks[-1]
            out.append(step(model, c, prev))
            toks.append(int(out[-1].argmax()))
        per = (time.time() - t) / (args.tokens - 1)
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
        "text": pathlib.Path(args.text).stem,
        "method": args.method,
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


if __name__ == "__main__":
    main()
