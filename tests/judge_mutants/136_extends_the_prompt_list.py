"""Mutant of exercise 136: `seen += output` extends the request's own prompt list."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "do not change prompt_ids or output_ids"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        seen = prompt_ids[i]
        seen += output_ids[i]  # MUTANT: extends prompt_ids[i] in place
        r = repetition_penalty[i]
        for token in set(seen):
            out[i, token] = out[i, token] / r if out[i, token] > 0 else out[i, token] * r
        for token, n in Counter(output_ids[i]).items():
            out[i, token] -= frequency_penalty[i] * n + presence_penalty[i]
    return out
