"""Mutant of exercise 137: the residual goes to sample() without being divided by its sum."""

import torch

EXPECTED_HINT = "not 1: normalise it"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), len(p)).to(p.dtype)
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        kept.append(sample(torch.clamp(p - q, min=0)))  # MUTANT: not normalised
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
