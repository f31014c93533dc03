"""Mutant of exercise 136: the result is a new torch.zeros(B, V), float32 whatever the logits' dtype."""

from collections import Counter

import torch

EXPECTED_HINT = "keep the logits' dtype"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = torch.zeros(logits.shape)  # MUTANT: the default dtype (float32), not the logits'
    for i in range(logits.shape[0]):
        row = logits[i].clone()
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        for token in set(prompt_ids[i]) | set(output_ids[i]):
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
        for token, n in counts.items():
            row[token] -= frequency_penalty[i] * n + presence_penalty[i]
        out[i] = row
    return out
