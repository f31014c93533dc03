"""Mutant of exercise 134: the room check asks for num_blocks free blocks, as if the hit needed new ones."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "the hit needs no new blocks"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    if num_blocks > pool.num_free:  # MUTANT: the hit counted as new blocks
        return None
    pool.touch(hit)
    return hit + pool.allocate(num_blocks - len(hit))
