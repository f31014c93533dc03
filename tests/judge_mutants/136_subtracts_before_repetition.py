"""Mutant of exercise 136: frequency and presence are subtracted first, then repetition goes by the new sign."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "repetition first, on the model's logit"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n
            out[i, token] -= presence_penalty[i]
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            if out[i, token] > 0:
                out[i, token] = out[i, token] / r
            else:
                out[i, token] = out[i, token] * r
    return out
