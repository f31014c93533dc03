"""Mutant of exercise 133: each block is hashed alone, without its parent: equal blocks after
different prefixes collide."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "the hashes are not chained"


def hash_chain(token_ids, block_size, cache_salt=None):  # noqa: F811
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = b"salt:" + cache_salt.encode() if start == 0 and cache_salt is not None else b""
        hashes.append(hash_block(None, token_ids[start:start + block_size], extra))  # MUTANT: parent None
    return hashes
