"""Mutant of exercise 136: vectorized with `x[ids] -= f`, which counts a repeated token once.

In PyTorch, `x[index] -= value` with an index tensor that holds a token several times reads and
writes each position once (it is `x[index] = x[index] - value`, not an accumulation), so the
frequency penalty of a token generated 3 times is subtracted once, as if it were presence. The fix is
a count: torch.bincount(ids, minlength=V), or index_add_ / scatter_add_, which do accumulate.
"""

import torch

EXPECTED_HINT = "how many times the token is in the OUTPUT"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        x = out[i]
        output = torch.tensor(list(output_ids[i]), dtype=torch.long)
        seen = torch.zeros(x.shape[0], dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids[i]), dtype=torch.long)] = True
        seen[output] = True
        r = repetition_penalty[i]
        x[seen] = torch.where(x[seen] > 0, x[seen] / r, x[seen] * r)
        x[output] -= frequency_penalty[i]  # MUTANT: a repeated index is written once, not once per occurrence
        x[output.unique()] -= presence_penalty[i]
    return out
