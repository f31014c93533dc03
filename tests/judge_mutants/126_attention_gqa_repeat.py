"""Mutant of exercise 126: KV heads tiled with repeat, so query head h reads KV head h % nkv."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat(1, nh // nkv, 1)  # MUTANT: should be repeat_interleave
    v = v.repeat(1, nh // nkv, 1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    return torch.einsum("htl,lhd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
