"""Mutant of exercise 128: a token's slot is its position, as if a sequence owned a contiguous cache."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401


def slot_mapping(block_ids, start, end, block_size):
    return torch.arange(start, end)  # MUTANT: should go through the block table


model_128.slot_mapping = slot_mapping  # the model's build_batch calls this one
