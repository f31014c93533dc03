"""Mutant of exercise 128: a sampling chunk's logits row is its first new token instead of its last."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    first = [out.query_start[s] for s, c in enumerate(chunks) if c.sample]  # MUTANT: query_start[s + 1] - 1
    return out._replace(logits_indices=torch.tensor(first, dtype=torch.long))
