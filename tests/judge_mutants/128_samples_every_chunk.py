"""Mutant of exercise 128: every chunk gets a logits row, even one in the middle of a prompt."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    last = [out.query_start[s + 1] - 1 for s in range(len(chunks))]  # MUTANT: ignores c.sample
    return out._replace(logits_indices=torch.tensor(last, dtype=torch.long))
