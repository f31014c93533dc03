"""Mutant of exercise 126: the scale as torch.sqrt(torch.tensor(hd)), a float32 tensor.

The scores stay float64 (a 0-d tensor does not change the dtype), but sqrt(hd) is rounded to
float32: off by up to 3e-8 of itself when hd is not a power of 4. On scores of a few units the
output moves by less than the tolerance; on scores in the hundreds it does not.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401

EXPECTED_HINT = "right only to float32 precision"
EXPECTED_CASE = "attention_over_a_cached_prefix"


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / torch.sqrt(torch.tensor(hd))  # MUTANT: float32 sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)
