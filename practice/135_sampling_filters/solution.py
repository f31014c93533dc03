"""Exercise 135: temperature, min-p, top-k and top-p. Edit this file, then run

    python practice/judge.py 135

The statement is in README.md. Both functions take the logits of one position, a 1-D float tensor
of shape (V,), one value per token of the vocabulary, and return a new tensor of the same shape:
leave the tensor you are given unchanged. float("-inf") marks a token that can no longer be drawn
(its probability after the softmax is 0).
"""

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """min-p, then top-k, then top-p, on logits already divided by the temperature.

    Every token the filters drop becomes -inf; the others keep their logits unchanged.
      min_p  drop tokens whose probability (softmax of logits) is below min_p x the largest one; 0 = off
      top_k  keep the k largest logits, and every logit equal to the k-th largest; 0 = no limit
      top_p  keep the smallest set of most likely tokens whose probabilities (after min-p and top-k,
             renormalized) reach top_p, the token that crosses it included; 1 = off
    """
    raise NotImplementedError


def distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> torch.Tensor:
    """The probabilities (V,) the next token is drawn from.

    A temperature below 1e-5 is greedy: probability 1 on the largest logit (the first of equal ones,
    as torch.argmax), 0 elsewhere, whatever the filters say. Otherwise: divide by the temperature,
    filter_logits, softmax.
    """
    raise NotImplementedError
