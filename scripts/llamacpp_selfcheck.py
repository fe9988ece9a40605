"""llama.cpp against itself: every teacher-forced position of an `attnstore argmax --out FILE`
output (with `--prompt-positions`, the prompt's positions too) evaluated by llama.cpp in
512-token batches and again one token at a time; the two argmax sequences compared with each
other and with the runtime's. How far llama.cpp's own numerics move the argmax is the floor
under issue 38's agreement goal. Prints one JSON line (the prompt's positions and the
continuation's apart, and each decisive difference from the batched run).

    target/llamacpp-venv/bin/python scripts/llamacpp_selfcheck.py FILE.json MODEL.gguf

(`scripts/llamacpp-check` builds that venv.)"""
import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def scores(model: str, tokens: list, batch: int) -> np.ndarray:
    """llama.cpp's logits at every position of `tokens`, evaluated `batch` tokens at a time."""
    llm = Llama(model_path=model, n_ctx=len(tokens) + 8, n_batch=batch, n_ubatch=batch, logits_all=True,
                verbose=False, seed=0)
    start = time.time()
    llm.eval(tokens)
    print(f"llama.cpp, batches of {batch}: {time.time() - start:.0f} s", file=sys.stderr)
    return np.asarray(llm.scores[: len(tokens)])


def probabilities(row: np.ndarray) -> np.ndarray:
    p = np.exp(row - row.max())
    return p / p.sum()


def agree(a: list, b: list) -> int:
    return sum(int(x == y) for x, y in zip(a, b))


def main() -> int:
    path, model = sys.argv[1], sys.argv[2]
    d = json.load(open(path))
    tokens, ours, start = d["tokens"], d["argmax"], d["argmax_from"]
    batched, single = scores(model, tokens, 512), scores(model, tokens, 1)
    n = len(ours)
    by_batch = [int(np.argmax(batched[start + i])) for i in range(n)]
    by_token = [int(np.argmax(single[start + i])) for i in range(n)]
    # Entries before `cont` are the prompt's positions (the last prompt token predicts the
    # continuation's first).
    cont = d["prompt_tokens"] - 1 - start
    decisive = []
    for i in range(n):
        p = probabilities(batched[start + i].astype(np.float64))
        top2 = np.sort(p)[-2:]
        if top2[1] - top2[0] >= 0.05 and ours[i] != by_batch[i]:
            q = probabilities(single[start + i].astype(np.float64))
            decisive.append({"position": i, "batched_p_top": round(float(p[by_batch[i]]), 3),
                             "batched_p_ours": round(float(p[ours[i]]), 3),
                             "single_p_batched_top": round(float(q[by_batch[i]]), 3),
                             "single_p_ours": round(float(q[ours[i]]), 3), "single_agrees_with_ours": by_token[i] == ours[i]})
    print(json.dumps({
        "file": path,
        "positions": n,
        "continuation": n - cont,
        "batched_vs_single": agree(by_batch, by_token),
        "ours_vs_batched": agree(ours, by_batch),
        "ours_vs_single": agree(ours, by_token),
        "continuation_batched_vs_single": agree(by_batch[cont:], by_token[cont:]),
        "continuation_ours_vs_batched": agree(ours[cont:], by_batch[cont:]),
        "continuation_ours_vs_single": agree(ours[cont:], by_token[cont:]),
        "decisive_differences_from_batched": decisive,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
