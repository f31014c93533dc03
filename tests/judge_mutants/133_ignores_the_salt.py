"""Mutant of exercise 133: the salt is ignored, so two users' prompts share blocks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "the salt is missing"


def hash_chain(token_ids, block_size, cache_salt=None):  # noqa: F811
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])  # MUTANT: no salt
        hashes.append(parent)
    return hashes
