"""Mutant of exercise 128: slots as int32 (as vLLM's block tables are), where the KV cache write needs torch.long."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import build_batch  # noqa: E402, F401

EXPECTED_HINT = "index_copy_(0, slot_mapping, k), which takes only a torch.long index"


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)],
                        dtype=torch.int32)  # MUTANT: should be torch.long


model_128.slot_mapping = slot_mapping  # the model's build_batch calls this one
