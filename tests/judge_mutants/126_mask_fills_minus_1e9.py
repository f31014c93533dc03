"""Mutant of exercise 126: the mask fills the hidden scores with -1e9 instead of -inf: a row whose visible scores are all below -1e9
puts its weight on a hidden key."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401

EXPECTED_HINT = "a finite mask value (-1e4, even -1e9) can lose to scores this large"
EXPECTED_CASE = "attention_scores_of_1e10_beat_any_finite_mask"


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, -1e9).softmax(dim=-1)  # MUTANT: a finite -1e9, not -inf
    return torch.einsum("htl,lhd->thd", probs, v)
