"""Mutant of exercise 136: every row uses the first request's penalties."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "each row is one request"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r, f, p = repetition_penalty[0], frequency_penalty[0], presence_penalty[0]  # MUTANT: row 0's
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            if out[i, token] > 0:
                out[i, token] = out[i, token] / r
            else:
                out[i, token] = out[i, token] * r
        for token, n in counts.items():
            out[i, token] -= f * n
            out[i, token] -= p
    return out
