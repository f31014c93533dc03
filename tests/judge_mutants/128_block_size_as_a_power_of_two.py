"""Mutant of exercise 128: the offset in a block as p & (block_size - 1), as if block_size were always a power of two.

vLLM's block sizes are powers of two (16, 32, ...), and so is the cases' 4, so every hand-made case
passes; with block_size 3, p & 2 is not p % 3.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401

EXPECTED_HINT = "is not a power of two: p & 2 is not p % 3"
EXPECTED_CASE = "slot_mapping_random_ranges"


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] * block_size + (p & (block_size - 1))  # MUTANT: p % block_size
                         for p in range(start, end)], dtype=torch.long)


model_128.slot_mapping = slot_mapping  # the model's build_batch calls this one
