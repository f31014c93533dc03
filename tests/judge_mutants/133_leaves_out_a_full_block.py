"""Mutant of exercise 133: the last FULL block is always left out, also when the last token is in a
partial block after it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "only the block holding the LAST token is left out"


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):  # noqa: F811
    blocks = []
    for h in hash_chain(token_ids, block_size, cache_salt)[:len(token_ids) // block_size - 1]:  # MUTANT
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks
