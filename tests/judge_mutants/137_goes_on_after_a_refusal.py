"""Mutant of exercise 137: after a refused draft it keeps testing the next ones."""

import torch

EXPECTED_HINT = "stop: draft 1 is not looked at"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept, refused = [], False
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), len(p)).to(p.dtype)
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        residual = (p - q).clamp(min=0)
        kept.append(sample(residual / residual.sum()))
        refused = True  # MUTANT: no return here
    if not refused:
        kept.append(sample(target_probs[len(draft_ids)]))
    return kept
