"""Mutant of exercise 126: attention casts its inputs to float64 to be exact and returns that.

On the float64 cases nothing shows; on float32 inputs the output comes back in float64.
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401

EXPECTED_HINT = "keep the inputs' dtype: compute in it, or cast the result back"


def attention(q, k, v, num_cached):
    q, k, v = q.double(), k.double(), v.double()  # MUTANT: never cast back to the inputs' dtype
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)
