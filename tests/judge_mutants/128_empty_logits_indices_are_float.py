"""Mutant of exercise 128: logits_indices built without a dtype, so a step where no chunk samples gets float32."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401

EXPECTED_HINT = "torch.tensor([]) of an empty list is float32"


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    rows = [out.query_start[s + 1] - 1 for s, c in enumerate(chunks) if c.sample]
    return out._replace(logits_indices=torch.tensor(rows))  # MUTANT: no dtype=torch.long; [] is float32
