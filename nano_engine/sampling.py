"""Sampling: turn each sampling row of logits into one token, by its own request's parameters.

Greedy (temperature below SAMPLING_EPS) is an argmax. Otherwise, in vLLM's order: divide by the
temperature first, then keep the top-k logits, keep the smallest set of tokens whose probability
(after the temperature) reaches top_p, and draw one. A request with a seed draws from its own
`torch.Generator`, so its tokens do not depend on what else shares the batch. Mirrors vLLM's
`vllm/v1/sample/sampler.py` and `vllm/v1/sample/ops/topk_topp_sampler.py`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .request import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus. logits: (V,)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p. The first token always stays,
        # also when top_p rounds to 0 in the logits' dtype: a row of only -inf would be NaN.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits (V,)."""
    if params.greedy:
        return int(logits.argmax())
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of logits (rows, V), row i by params[i] and generators[i]."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()  # one call for the common case
    return [sample_one(row, p, g) for row, p, g in zip(logits, params, generators)]
