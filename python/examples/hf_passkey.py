"""Passkey retrieval inside transformers: exact (SDPA) against attnstore's sparse plan.

A secret number is hidden at `--depths` of a haystack (HACK's paper, `runtime/data/hack.txt`,
as the Rust runtime's `attnstore eval` does) in a prompt of `--length` tokens; the model is
asked for it at the end. Per depth the prompt is prefilled once by SDPA (in chunks); SDPA's
greedy answer is the exact one, and an attnstore cache filled with the same prompt KV answers
with the default sparse plan (`attnstore.hf.model_budget()`, or `--scale`d). A needle counts
as found when the answer's first `--answer` tokens contain the number.

    target/pyenv/bin/python python/examples/hf_passkey.py --model gemma3 --length 16384
"""

import argparse
import json
import pathlib
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from hf_eval import MODELS, ROOT, SYSTEM, filled_cache, prefill, step  # noqa: E402

import attnstore  # noqa: E402
import attnstore.hf  # noqa: E402


def passkey_prompt(tok, model, haystack, length, depth, key):
    chat = model == "smollm2"
    head = (SYSTEM if chat else "") + "There is a secret number hidden in the following text. Find it and remember it.\n\n"
    tail = "\n\nWhat is the secret number?" + ("<|im_end|>\n<|im_start|>assistant\n" if chat else "") + (
        "The secret number is" if chat else " The secret number is"
    )
    prefix = tok.encode(head)
    needle = tok.encode(f" The secret number is {key}. Remember it. {key} is the secret number. ", add_special_tokens=False)
    suffix = tok.encode(tail, add_special_tokens=False)
    body = tok.encode(haystack, add_special_tokens=False)
    n = length - len(prefix) - len(needle) - len(suffix)
    if not 0 <= n <= len(body):
        raise SystemExit(f"a prompt of {length} tokens needs {n} tokens of haystack; it has {len(body)}")
    at = int(n * depth)
    return torch.tensor([prefix + body[:at] + needle + body[at:n] + suffix])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="gemma3")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--haystack", default=str(ROOT / "runtime/data/hack.txt"))
    args = ap.parse_args()
    name = MODELS[args.model][0]
    tok = AutoTokenizer.from_pretrained(ROOT / "models", gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models", gguf_file=name, dtype=torch.float32).eval()
    torch.set_grad_enabled(False)
    budget = attnstore.hf.model_budget(args.scale)
    haystack = pathlib.Path(args.haystack).read_text()
    rng = random.Random(7)
    found = {"exact": 0, "attnstore": 0}
    answers = {"exact": [], "attnstore": []}
    depths = [float(d) for d in args.depths.split(",")]
    for depth in depths:
        key = rng.randrange(10_000, 100_000)
        ids = passkey_prompt(tok, args.model, haystack, args.length, depth, key)
        logits, cache, prompt_kv = prefill(model, ids, args.chunk)
        first = int(logits.argmax())
        for variant in ("exact", "attnstore"):
            if variant == "exact":
                model.set_attn_implementation("sdpa")
                c = cache
            else:
                c = filled_cache(model, prompt_kv, budget=budget)
            toks = [first]
            while len(toks) < args.answer:
                toks.append(int(step(model, c, toks[-1]).argmax()))
            text = tok.decode(toks)
            found[variant] += str(key) in text
            answers[variant].append(text.strip().replace("\n", " "))
            print(f"depth {depth}: key {key}, {variant}: {text!r}", flush=True)
            if variant != "exact":
                c.close()
        del cache, prompt_kv
    row = {
        "model": args.model,
        "length": args.length,
        "budget_scale": args.scale,
        "trials": len(depths),
        "exact_found": found["exact"],
        "attnstore_found": found["attnstore"],
        "answers": answers,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
