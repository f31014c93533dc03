"""Mutant of exercise 136: vectorized with float32 counts, so float64 logits get float32 penalties."""

import torch

EXPECTED_HINT = "float32 counts (bincount(...).float())"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        counts = torch.bincount(torch.tensor(output_ids[i], dtype=torch.long), minlength=vocab).float()  # MUTANT
        seen = counts > 0
        seen[torch.tensor(prompt_ids[i], dtype=torch.long)] = True
        r = torch.tensor(repetition_penalty[i])
        x = out[i]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - frequency_penalty[i] * counts - presence_penalty[i] * (counts > 0).float()
        out[i] = x
    return out
