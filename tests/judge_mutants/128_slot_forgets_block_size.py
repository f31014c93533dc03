"""Mutant of exercise 128: slot = block id + offset, as if each block were one slot wide."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401

EXPECTED_HINT = "a block owns block_size slots"


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] + p % block_size for p in range(start, end)],
                        dtype=torch.long)  # MUTANT: block_ids[...] * block_size + offset


model_128.slot_mapping = slot_mapping
