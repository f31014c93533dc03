"""Mutant of exercise 134: a failed admit touches the hit, then gives it back: the hit moves to the
end of the free queue."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "a failed admit must leave the pool as it was"


def admit(pool, hashes, num_blocks):  # noqa: F811
    hit = pool.lookup(hashes)
    pool.touch(hit)
    try:
        return hit + pool.allocate(num_blocks - len(hit))
    except ValueError:  # MUTANT: undo instead of deciding first
        pool.free(hit[::-1])
        return None
