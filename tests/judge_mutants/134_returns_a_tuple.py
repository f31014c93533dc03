"""Mutant of exercise 134: admit returns the block table as a tuple, not a list."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit as _admit, release  # noqa: E402,F401

EXPECTED_HINT = "admit returns the block table, a list of block ids, or None"


def admit(pool, hashes, num_blocks):
    table = _admit(pool, hashes, num_blocks)
    return None if table is None else tuple(table)  # MUTANT: a tuple
