"""Mutant of exercise 137: the test u < p(x) / q(x) written without the division, u * q(x) < p(x): the
same where q(x) > 0, but a draft the proposer gave probability 0 is kept whenever p(x) > 0."""

import torch

EXPECTED_HINT = "there is no ratio p / q to test"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[j]
        if uniforms[j] * q[x] < p[x]:  # MUTANT: no q(x) > 0 test
            kept.append(x)
            continue
        residual = torch.clamp(p - q, min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
