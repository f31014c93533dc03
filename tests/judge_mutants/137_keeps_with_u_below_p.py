"""Mutant of exercise 137: the test ignores q (u < p(x), as if every proposer were one-hot)."""

import torch

EXPECTED_HINT = "u < p alone would refuse it"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = torch.zeros_like(p)
        q[x] = 1.0
        if draft_probs is not None:
            q = draft_probs[j]
        if uniforms[j] < p[x]:  # MUTANT: p(x), not p(x) / q(x)
            kept.append(x)
            continue
        residual = torch.clamp(p - q, min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
