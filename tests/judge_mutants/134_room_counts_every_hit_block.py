"""Mutant of exercise 134: the room check counts every hit block against the free ones, also the blocks
another request holds (they are not in the free queue, so touching them takes nothing from it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import release  # noqa: E402,F401

EXPECTED_HINT = "only its free blocks leave the free queue when touched"


def admit(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    need = num_blocks - len(hit)
    if need + len(hit) > pool.num_free:  # MUTANT: should count only the hit blocks with ref_count 0
        return None
    pool.touch(hit)
    return hit + pool.allocate(need)
