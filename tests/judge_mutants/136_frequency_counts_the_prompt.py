"""Mutant of exercise 136: frequency counts the prompt's occurrences too."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "a token only in the prompt is not touched"


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
        for token, n in (counts + Counter(prompt_ids[i])).items():  # MUTANT: prompt + output
            out[i, token] -= frequency_penalty[i] * n
        for token in counts:
            out[i, token] -= presence_penalty[i]
    return out
