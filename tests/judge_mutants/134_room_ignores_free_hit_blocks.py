"""Mutant of exercise 134: the room check forgets that free hit blocks leave the free queue when touched."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "touching a free hit block takes it out of the free queue"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    if num_blocks - len(hit) > pool.num_free:  # MUTANT: free hit blocks not counted
        return None
    pool.touch(hit)
    return hit + pool.allocate(num_blocks - len(hit))
