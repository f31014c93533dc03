"""Mutant of exercise 135: top-k keeps exactly k tokens (torch.topk's indices), breaking ties at the k-th logit."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "ties at the k-th largest logit all stay"


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = logits.clone()
    if min_p > 0:
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p * probs.max()] = NEG_INF
    if top_k > 0 and top_k < len(out):
        keep = torch.zeros(len(out), dtype=torch.bool)
        keep[torch.topk(out, top_k).indices] = True  # MUTANT: exactly k, one of the tied ones is dropped
        out[~keep] = NEG_INF
    if top_p < 1:
        probs = torch.softmax(out.double(), -1).tolist()
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        total = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and total >= top_p:
                out[i] = NEG_INF
            total += probs[i]
    return out
