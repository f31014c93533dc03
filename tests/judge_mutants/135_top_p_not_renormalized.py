"""Mutant of exercise 135: top-p adds up the probabilities of the unfiltered distribution, not of what min-p and top-k left."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "renormalized"


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = logits.clone()
    original = torch.softmax(logits.double(), -1).tolist()  # MUTANT: before min-p and top-k
    if min_p > 0:
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p * probs.max()] = NEG_INF
    if top_k > 0 and top_k < len(out):
        kth = sorted(out.tolist(), reverse=True)[top_k - 1]
        out[out < kth] = NEG_INF
    if top_p < 1:
        order = sorted((i for i in range(len(out)) if out[i] > NEG_INF), key=lambda i: -original[i])
        total = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and total >= top_p:
                out[i] = NEG_INF
            total += original[i]
    return out
