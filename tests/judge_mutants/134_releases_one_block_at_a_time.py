"""Mutant of exercise 134: release frees the blocks tail first but one call each, so the unnamed blocks
(a duplicate of a cached block, the partial tail) reach the front in reverse: the tail behind the duplicate."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_134 import admit, release  # noqa: E402,F401

EXPECTED_HINT = "release frees the whole table in ONE call"


def release(pool, block_ids):  # noqa: F811
    for b in reversed(block_ids):  # MUTANT: one pool.free call per block
        pool.free([b])
