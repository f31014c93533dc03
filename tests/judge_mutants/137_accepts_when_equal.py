"""Mutant of exercise 137: vLLM's `ratio >= u`, which keeps a draft of probability 0 when u is 0."""

import torch

EXPECTED_HINT = "u = 0 is not below it"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), len(p)).to(p.dtype)
        if q[x] > 0 and p[x] / q[x] >= uniforms[j]:  # MUTANT: >= instead of <
            kept.append(x)
            continue
        residual = (p - q).clamp(min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
