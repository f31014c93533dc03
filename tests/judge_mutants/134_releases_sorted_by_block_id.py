"""Mutant of exercise 134: release frees the blocks by descending block id, taking the largest id for the tail."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "not sorted by block id"


def release(pool, block_ids):  # noqa: F811
    pool.free(sorted(block_ids, reverse=True))  # MUTANT: block ids, not the table's order
