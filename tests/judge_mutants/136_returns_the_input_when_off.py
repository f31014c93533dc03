"""Mutant of exercise 136: with every penalty off it hands back the logits given, not a new tensor."""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "return a new tensor also when no penalty is on"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    if all(r == 1 for r in repetition_penalty) and not any(frequency_penalty) and not any(presence_penalty):
        return logits  # MUTANT: nothing to do, so no copy
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            out[i, token] = out[i, token] / r if out[i, token] > 0 else out[i, token] * r
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n + presence_penalty[i]
    return out
