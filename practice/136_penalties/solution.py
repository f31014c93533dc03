"""Exercise 136: repetition, frequency and presence penalties over a batch. Edit this file, then run

    python practice/judge.py 136

The statement is in README.md. `logits` is a float tensor (B, V): one row per request in the batch,
one column per token of the vocabulary. Row i belongs to the request whose prompt is prompt_ids[i],
whose generated tokens so far are output_ids[i] (lists of token ids, possibly empty, tokens may
repeat) and whose penalties are repetition_penalty[i], frequency_penalty[i], presence_penalty[i].
Return a new tensor (B, V); leave the one you are given unchanged.
"""

from typing import Sequence

import torch


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    repetition_penalty: Sequence[float], frequency_penalty: Sequence[float],
                    presence_penalty: Sequence[float]) -> torch.Tensor:
    """The logits of each row after its request's penalties, in this order:

    1. repetition (1 = off): every token in the prompt or the output, once: a positive logit is
       divided by the penalty, a negative one multiplied by it;
    2. frequency (0 = off): subtract penalty x (the token's count in the output);
    3. presence (0 = off): subtract the penalty once from each token that is in the output.
    """
    raise NotImplementedError
