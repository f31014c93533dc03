"""Mutant of exercise 126: rotates neighbours (2i, 2i + 1), GPT-J style, instead of the two halves."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_126 import attention  # noqa: E402, F401


def apply_rope(x, cos, sin):
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # MUTANT: adjacent pairs
    return x * cos[:, None, :] + rotated * sin[:, None, :]
