"""Mutant of exercise 134: admit never looks at the prefix cache."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "look up the cached prefix first"


def admit(pool, hashes, num_blocks):  # noqa: F811
    if num_blocks > pool.num_free:  # MUTANT: no lookup, every block new
        return None
    return pool.allocate(num_blocks)
