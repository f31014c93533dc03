"""Mutant of exercise 126: no mask, so every query sees the keys after it."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import apply_rope  # noqa: E402, F401


def attention(q, k, v, num_cached):
    nh, nkv, hd = q.shape[1], k.shape[1], q.shape[2]
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    probs = (q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(hd)).softmax(dim=-1)  # MUTANT: no mask
    return (probs @ v.transpose(0, 1)).transpose(0, 1)
