"""A learner-style solution of exercise 126, written from the statement alone: it passes every case.

Attention by hand (matmuls, a mask, a softmax), not scaled_dot_product_attention. The mutants next
to it reuse one function and break the other.
"""

import math

import torch


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q, k, v, num_cached):
    T, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(nh // nkv, dim=1)  # (L, nh, hd): query head h reads KV head h // (nh // nkv)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(hd)  # (nh, T, L)
    mask = torch.ones(T, L, dtype=torch.bool).tril(diagonal=num_cached)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", probs, v)
