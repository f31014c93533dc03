"""Mutant of exercise 133: the lookup hashes the prompt without its salt."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "look up with the request's salt"


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):  # noqa: F811
    most = (len(token_ids) - 1) // block_size
    blocks = []
    for h in hash_chain(token_ids, block_size)[:most]:  # MUTANT: the salt is not passed on
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks
