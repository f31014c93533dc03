"""A learner-style solution of exercise 136, written from the statement alone: it passes every case.

A loop over rows and over the tokens each request has seen, nothing taken from nano_engine.sampling.
The mutants next to it (136_*.py) change one thing each.
"""

from collections import Counter

import torch


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            if out[i, token] > 0:
                out[i, token] = out[i, token] / r
            else:
                out[i, token] = out[i, token] * r
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n
            out[i, token] -= presence_penalty[i]
    return out
