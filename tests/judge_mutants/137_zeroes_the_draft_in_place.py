"""Mutant of exercise 137: q = None handled by zeroing the draft's entry of p itself."""

EXPECTED_HINT = "p[x] = 0 changes the caller's p"


def rejection_sample(target_probs, draft_ids, uniforms, sample, draft_probs=None):
    kept = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        if draft_probs is None:
            if uniforms[j] < p[x]:
                kept.append(x)
                continue
            p[x] = 0.0  # MUTANT: writes into target_probs
            kept.append(sample(p / p.sum()))
            return kept
        q = draft_probs[j]
        if q[x] > 0 and uniforms[j] < p[x] / q[x]:
            kept.append(x)
            continue
        residual = (p - q).clamp(min=0)
        kept.append(sample(residual / residual.sum()))
        return kept
    kept.append(sample(target_probs[len(draft_ids)]))
    return kept
