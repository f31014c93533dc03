"""Mutant of exercise 136: the repetition penalty divides every seen logit, also a negative one, which it raises."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "a negative logit is multiplied by r"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            out[i, token] = out[i, token] / r  # MUTANT: whatever the sign
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n
            out[i, token] -= presence_penalty[i]
    return out
