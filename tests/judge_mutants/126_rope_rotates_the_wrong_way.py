"""Mutant of exercise 126: rotate_half as cat(x2, -x1), so every pair turns the other way."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import attention  # noqa: E402, F401


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x2, -x1), dim=-1)  # MUTANT: should be cat(-x2, x1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
