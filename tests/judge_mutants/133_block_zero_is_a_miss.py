"""Mutant of exercise 133: the lookup tests the block id it finds for truth, so a hit in block 0 reads as
a miss and stops the run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain  # noqa: E402,F401

EXPECTED_HINT = "block 0 is a block id like any other"


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):
    most = (len(token_ids) - 1) // block_size
    blocks = []
    for h in hash_chain(token_ids, block_size, cache_salt)[:most]:
        block = cached.get(h)
        if not block:  # MUTANT: block 0 is falsy; `block is None` is the miss
            break
        blocks.append(block)
    return blocks
