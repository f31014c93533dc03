"""Mutant of exercise 128: positions left as a Python list; the values are right, the type is not a tensor."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401

EXPECTED_HINT = "positions goes to the engine as a tensor, not a list"


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    positions = [p for c in chunks for p in range(c.num_cached, c.num_cached + len(c.token_ids))]
    return out._replace(positions=positions)  # MUTANT: should be torch.tensor(positions, dtype=torch.long)
