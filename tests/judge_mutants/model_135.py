"""A learner-style solution of exercise 135, written from the statement alone: it passes every case.

Plain loops over sorted probabilities in float64, nothing taken from nano_engine.sampling. The
mutants next to it (135_*.py) change one thing each.
"""

import torch

NEG_INF = float("-inf")


def filter_logits(logits, top_k, top_p, min_p=0.0):
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
            if rank > 0 and total >= top_p:
                out[i] = NEG_INF
            total += probs[i]
    return out


def distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    if temperature < 1e-5:
        probs = torch.zeros(len(logits))
        probs[int(torch.argmax(logits))] = 1.0
        return probs
    return torch.softmax(filter_logits(logits.double() / temperature, top_k, top_p, min_p), -1)
