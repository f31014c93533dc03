"""Mutant of exercise 134: release frees the table head first, so a request's shared head is evicted before its tail."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "release frees the table TAIL FIRST"


def release(pool, block_ids):  # noqa: F811
    pool.free(block_ids)  # MUTANT: not reversed
