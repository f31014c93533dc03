"""Mutant of exercise 133: a partial last block is hashed too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "only FULL blocks are hashed"


def hash_chain(token_ids, block_size, cache_salt=None):  # noqa: F811
    hashes, parent = [], None
    for start in range(0, len(token_ids), block_size):  # MUTANT: the partial block too
        extra = b"salt:" + cache_salt.encode() if start == 0 and cache_salt is not None else b""
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes
