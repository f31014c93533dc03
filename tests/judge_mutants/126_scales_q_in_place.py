"""Mutant of exercise 126: the scale is applied to q in place (q *= 1 / sqrt(hd)): the output is right,
and the caller's q has changed."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401

EXPECTED_HINT = "do not write into your inputs"


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    q *= 1 / math.sqrt(hd)  # MUTANT: writes into the caller's q
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)
