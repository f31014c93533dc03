"""Exercise 126: rotary embedding and causal grouped-query attention. Edit this file, then run

    python practice/judge.py 126

Implement the two functions below; the statement is in README.md. The judge compares them with
nano_engine.mini_llm's on random tensors, then lets the tiny model generate with them.

Shapes, as in nano_engine.mini_llm (tokens are flat: no batch dimension):
  T   new tokens of one sequence in this forward pass (the prompt, a chunk of it, or 1 decode)
  nh  query heads, nkv KV heads (nh is a multiple of nkv), hd the head dimension
"""

import math  # math.sqrt

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x by its token's angles. x: (T, nh, hd); cos, sin: (T, hd). Returns (T, nh, hd).

    Split each head into halves x1 = x[..., :hd/2] and x2 = x[..., hd/2:]; then
    out = x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) on the last dimension.
    cos and sin hold one row per token: broadcast them over the heads.
    """
    raise NotImplementedError


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Causal attention of T new queries over L = num_cached + T keys. Returns (T, nh, hd).

    q: (T, nh, hd), the new tokens' queries; k, v: (L, nkv, hd), the cached tokens' keys and values
    followed by the new tokens' own. Query i sits at position num_cached + i and sees keys
    0..num_cached + i (itself included, nothing after it). Query head h reads KV head
    h // (nh // nkv). Scores are q . k / sqrt(hd), softmax over the keys, then a weighted sum of v.
    """
    raise NotImplementedError
