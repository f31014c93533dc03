"""Mutant of exercise 142: q = round(w * (1 / scale)), a multiplication by the reciprocal instead of the division."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_142 import dequantize, int4_linear, pack_int4, unpack_int4  # noqa: E402,F401

EXPECTED_HINT = "q is w * (1 / scale)"


def quantize_int4(w, group_size):
    n, k = w.shape
    groups = -(-k // group_size)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, groups)
    for g in range(groups):
        cols = slice(g * group_size, min((g + 1) * group_size, k))
        scale = (w[:, cols].abs().amax(dim=1) / 7).clamp(min=1e-12)
        scales[:, g] = scale
        q[:, cols] = torch.round(w[:, cols] * (1 / scale[:, None])).clamp(-8, 7).to(torch.int8)  # MUTANT: times the reciprocal
    return q, scales
