"""Mutant of exercise 137: the residual p - q keeps its negative entries."""

import torch

EXPECTED_HINT = "(the residual of draft 0: max(0, p - q) normalised)"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), len(p)).to(p.dtype)
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        residual = p - q  # MUTANT: no clamp
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
