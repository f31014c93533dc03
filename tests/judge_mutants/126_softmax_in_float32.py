"""Mutant of exercise 126: the softmax runs in float32 (a habit from GPU code), then casts back.

The output has the inputs' dtype, float64, but only float32's precision: about 1e-8 off, which
4-decimal printing hides.
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).float().softmax(dim=-1).to(q.dtype)  # MUTANT: float32
    return torch.einsum("htl,lhd->thd", probs, v)
