"""A learner-style solution of exercise 137, written from the statement alone: it passes every case.

A loop over the drafts with the one-hot q built by hand, nothing taken from nano_engine.sampling.
The mutants next to it (137_*.py) change one thing each.
"""

import torch


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[j]
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        residual = torch.clamp(p - q, min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
