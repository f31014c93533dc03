"""Mutant of exercise 142: q = round(w / scale) with the division in float64."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_142 import dequantize, int4_linear, pack_int4, unpack_int4  # noqa: E402,F401

EXPECTED_HINT = "divided in float64"


def quantize_int4(w, group_size):
    n, k = w.shape
    groups = -(-k // group_size)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, groups)
    for g in range(groups):
        cols = slice(g * group_size, min((g + 1) * group_size, k))
        scale = (w[:, cols].abs().amax(dim=1) / 7).clamp(min=1e-12)
        scales[:, g] = scale
        q[:, cols] = torch.round(w[:, cols].double() / scale[:, None].double()).clamp(-8, 7).to(torch.int8)  # MUTANT: float64
    return q, scales
