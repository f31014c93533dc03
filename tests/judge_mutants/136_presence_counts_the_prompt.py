"""Mutant of exercise 136: presence is subtracted from every token seen, the prompt's too.

The learner reuses repetition's set of seen tokens (prompt + output) for presence: "present" read as
"present in the request". OpenAI's presence penalty, like frequency, looks at the generated tokens
only, so a token that is only in the prompt keeps its logit.
"""

from collections import Counter

import torch  # noqa: F401

EXPECTED_HINT = "the prompt does not count"


def apply_penalties(logits, prompt_ids, output_ids, repetition_penalty, frequency_penalty, presence_penalty):
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = Counter(output_ids[i])
        r = repetition_penalty[i]
        seen = set(prompt_ids[i]) | set(output_ids[i])
        for token in seen:
            if out[i, token] > 0:
                out[i, token] = out[i, token] / r
            else:
                out[i, token] = out[i, token] * r
        for token, n in counts.items():
            out[i, token] -= frequency_penalty[i] * n
        for token in seen:  # MUTANT: the prompt's tokens too
            out[i, token] -= presence_penalty[i]
    return out
