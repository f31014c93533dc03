"""Mutant of exercise 135: top-k keeps the tokens whose logit is among the k largest DISTINCT values.

Reading "ties at the k-th logit all stay" as "equal logits count as one", the learner takes the k-th
of the sorted unique logits: a tie above the k-th (3, 3, 1 with k = 2) pushes the cut down and keeps
the 1 too. The hand-made cases only tie at or below the k-th logit, where both readings agree; only
random logits drawn from a few values put a tie above it.
"""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "counting equal logits one by one"
EXPECTED_CASE = "random_logits_filter_logits"


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = logits.clone()
    if min_p > 0:
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p * probs.max()] = NEG_INF
    distinct = sorted(set(out.tolist()), reverse=True)  # MUTANT: equal logits counted once
    if top_k > 0 and top_k < len(distinct):
        out[out < distinct[top_k - 1]] = NEG_INF
    if top_p < 1:
        probs = torch.softmax(out.double(), -1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        total = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and total >= top_p:
                out[i] = NEG_INF
            total += probs[i]
    return out
