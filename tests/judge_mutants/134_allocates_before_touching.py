"""Mutant of exercise 134: the new blocks are allocated before the hit is touched, so allocate can
evict a block of the hit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "touch the hit BEFORE allocating"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    new = num_blocks - len(hit)
    if new + len([b for b in hit if pool.ref_count[b] == 0]) > pool.num_free:
        return None
    table = pool.allocate(new)  # MUTANT: before touch
    pool.touch(hit)
    return hit + table
