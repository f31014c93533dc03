"""Mutant of exercise 135: top-p drops a token only when the tokens before it go strictly above
top_p (`>` for `>=`), so a set that reaches top_p exactly keeps one token too many. Random logits
never land exactly on the threshold: only a case built for it can tell."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "also when they reach it exactly"


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = logits.clone()
    if min_p > 0:
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p * probs.max()] = NEG_INF
    if top_k > 0 and top_k < len(out):
        kth = sorted(out.tolist(), reverse=True)[top_k - 1]
        out[out < kth] = NEG_INF
    if top_p < 1:
        probs = torch.softmax(out.double(), -1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        total = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and total > top_p:  # MUTANT: should be >=
                out[i] = NEG_INF
            total += probs[i]
    return out
