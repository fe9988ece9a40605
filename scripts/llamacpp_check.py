"""Compares attnstore's teacher-forced argmax (from `attnstore argmax --out FILE`) with
llama.cpp's over the same token ids, and the tokenizations of the same prompt text.
Prints one JSON line (with the agreement over decisive positions — not near ties — and every
difference with llama.cpp's probabilities) and exits 1 if argmax agreement is below 95%."""
import json
import sys

import numpy as np
from llama_cpp import Llama


def main() -> int:
    path, model = sys.argv[1], sys.argv[2]
    d = json.load(open(path))
    tokens = d["tokens"]
    llm = Llama(model_path=model, n_ctx=max(512, len(tokens) + 8), logits_all=True, verbose=False, seed=0)
    theirs_prompt = llm.tokenize(d["prompt_text"].encode("utf-8"), add_bos=d.get("add_bos", False), special=True)
    ours_prompt = tokens[: d["prompt_tokens"]]
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens)])
    start = d["argmax_from"]
    ours = d["argmax"]
    theirs = [int(np.argmax(scores[start + i])) for i in range(len(ours))]
    agree = sum(int(a == b) for a, b in zip(ours, theirs))
    # Near ties: llama.cpp's two most likely tokens within 0.05 probability, where summation
    # order or the KV cache's precision may flip the argmax (attnstore eval's definition).
    decisive, decisive_agree, differ = 0, 0, []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        row = scores[start + i].astype(np.float64)
        p = np.exp(row - row.max())
        p /= p.sum()
        top2 = np.sort(p)[-2:]
        tie = top2[1] - top2[0] < 0.05
        decisive += int(not tie)
        decisive_agree += int(not tie and a == b)
        if a != b:
            differ.append({"position": i, "llamacpp": b, "ours": a, "p_llamacpp_top": round(float(p[b]), 5),
                           "p_llamacpp_of_ours": round(float(p[a]), 5)})
    out = {
        "file": path,
        "positions": len(ours),
        "argmax_agree": agree,
        "agreement": agree / max(1, len(ours)),
        "decisive_positions": decisive,
        "decisive_agree": decisive_agree,
        "differences": differ,
        "tokenization_equal": theirs_prompt == ours_prompt,
        "prompt_tokens": len(ours_prompt),
        "llamacpp_prompt_tokens": len(theirs_prompt),
    }
    print(json.dumps(out))
    return 0 if out["agreement"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
