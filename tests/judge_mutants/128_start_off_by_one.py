"""Mutant of exercise 128: slots of positions start + 1 .. end, one past the new tokens'."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start + 1, end + 1)])  # MUTANT: should be range(start, end)


model_128.slot_mapping = slot_mapping
