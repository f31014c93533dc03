"""Mutant of exercise 126: the softmax written out as exp(s) / sum(exp(s)), without subtracting each row's max.

On scores of a few units nothing shows; once a score passes about 709 (float64) exp gives inf, and
inf / inf is NaN.
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401

EXPECTED_HINT = "subtract each row's largest score before exp"
EXPECTED_CASE = "attention_scores_of_1e10_beat_any_finite_mask"


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    e = scores.exp().masked_fill(~mask, 0.0)  # MUTANT: exp of the raw scores overflows to inf
    probs = e / e.sum(dim=-1, keepdim=True)
    return torch.einsum("htl,lhd->thd", probs, v)
