"""Mutant of exercise 137: the bonus is drawn from the last draft's row, not from the row after it."""

import torch

EXPECTED_HINT = "(the bonus: the last row of target_probs)"


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
    kept.append(sample(target_probs[max(len(draft_ids) - 1, 0)]))  # MUTANT: row d - 1
    return kept
