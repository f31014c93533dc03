"""Mutant of exercise 137: when every draft is kept, no bonus token."""

import torch

EXPECTED_HINT = "expected sample() to be called 1 time(s)"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), len(p)).to(p.dtype)
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        residual = (p - q).clamp(min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    return kept  # MUTANT: the bonus is missing
