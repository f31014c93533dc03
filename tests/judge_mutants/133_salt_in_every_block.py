"""Mutant of exercise 133: the salt is mixed into every block, not only the first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "the salt is an extra key of the FIRST block only"


def hash_chain(token_ids, block_size, cache_salt=None):  # noqa: F811
    extra = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra)  # MUTANT: every block
        hashes.append(parent)
    return hashes
