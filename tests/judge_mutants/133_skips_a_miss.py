"""Mutant of exercise 133: a block that is not cached is skipped, and the run goes on after it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "the run stops at the first block that is not cached"


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):  # noqa: F811
    most = (len(token_ids) - 1) // block_size
    return [cached[h] for h in hash_chain(token_ids, block_size, cache_salt)[:most] if h in cached]  # MUTANT
