"""Mutant of exercise 134: admit touches the hit first ("touch the hit first"), then checks the room for
the new blocks, and returns None with the hit still touched: a failed admission keeps references."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import release  # noqa: E402,F401

EXPECTED_HINT = "a failed admit must change nothing"


def admit(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    pool.touch(hit)
    need = num_blocks - len(hit)
    if need > pool.num_free:  # MUTANT: decided after touching, and the touch is not undone
        return None
    return hit + pool.allocate(need)
