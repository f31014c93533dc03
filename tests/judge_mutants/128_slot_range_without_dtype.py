"""Mutant of exercise 128: slot_mapping builds its tensor with torch.tensor(list), without a dtype.

A list of ints gives torch.long, so every chunk of a batch passes; an empty range (start == end)
gives torch.tensor([]), float32, which no cache write can take as an index.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401

EXPECTED_HINT = "torch.tensor([]) of an empty list is float32, and the KV cache is written with index_copy_"
EXPECTED_CASE = "slot_mapping_random_ranges"


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size
                         for p in range(start, end)])  # MUTANT: no dtype=torch.long; [] is float32


model_128.slot_mapping = slot_mapping  # the model's build_batch calls this one
