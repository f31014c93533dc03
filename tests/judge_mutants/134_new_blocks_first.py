"""Mutant of exercise 134: the block table lists the new blocks before the hit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "the hit blocks first"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    if num_blocks - len(hit) + len([b for b in hit if pool.ref_count[b] == 0]) > pool.num_free:
        return None
    pool.touch(hit)
    return pool.allocate(num_blocks - len(hit)) + hit  # MUTANT: new blocks first
