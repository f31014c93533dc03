"""Mutant of exercise 134: the hit is used without taking a reference to it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "touch the hit: each hit block gets one more reference"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    if num_blocks - len(hit) + len([b for b in hit if pool.ref_count[b] == 0]) > pool.num_free:
        return None
    return hit + pool.allocate(num_blocks - len(hit))  # MUTANT: no touch
