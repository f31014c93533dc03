"""Mutant of exercise 136: the repetition penalty is applied once per occurrence, r ** count."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "not by r ** count"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token in list(prompt_ids[i]) + list(output_ids[i]):  # MUTANT: every occurrence
            if out[i, token] > 0:
                out[i, token] = out[i, token] / r
            else:
                out[i, token] = out[i, token] * r
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n
            out[i, token] -= presence_penalty[i]
    return out
