"""Mutant of exercise 134: admit allocates num_blocks new blocks on top of the hit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "allocate only the blocks the hit does not cover"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    if num_blocks + len([b for b in hit if pool.ref_count[b] == 0]) > pool.num_free:
        return None
    pool.touch(hit)
    return hit + pool.allocate(num_blocks)  # MUTANT: num_blocks, not num_blocks - len(hit)
