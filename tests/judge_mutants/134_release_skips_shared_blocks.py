"""Mutant of exercise 134: release skips the blocks another request shares, so they are never freed."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "EVERY block of its table"


def release(pool, block_ids):  # noqa: F811
    pool.free([b for b in block_ids[::-1] if pool.ref_count[b] == 1])  # MUTANT: shared blocks kept
