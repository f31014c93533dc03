"""Exercise 137: the rejection sampler of speculative decoding. Edit this file, then run

    python practice/judge.py 137

The statement is in README.md. `target_probs` is a float tensor (d + 1, V): row j is the model's
distribution p over the vocabulary at the position of draft j (row d: after the last draft).
`draft_ids` is the list of the d draft tokens; `uniforms` a list of d floats in [0, 1), one per
acceptance test; `sample(probs)` draws a token from a distribution (V,) that sums to 1 and returns
its id; `draft_probs` is the proposer's distribution q, a tensor (d, V), or None for a proposer
that is sure of its drafts (q one-hot on the draft, as the n-gram proposer). Leave the tensors
you are given unchanged.
"""

from typing import Callable, Sequence

import torch


def rejection_sample(target_probs: torch.Tensor, draft_ids: Sequence[int], uniforms: Sequence[float],
                     sample: Callable[[torch.Tensor], int], draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens the request keeps from this step, in order: the drafts accepted, then one more token
    (the correction of the first refused draft, or the bonus after the last)."""
    raise NotImplementedError
