"""Mutant of exercise 128: each chunk's positions start at 0, forgetting the tokens already cached."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401

EXPECTED_HINT = "positions continue from num_cached"


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    positions = [p for c in chunks for p in range(len(c.token_ids))]  # MUTANT: range(num_cached, num_cached + n)
    return out._replace(positions=torch.tensor(positions, dtype=torch.long))
