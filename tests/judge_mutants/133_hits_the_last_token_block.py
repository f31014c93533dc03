"""Mutant of exercise 133: the block holding the last token may hit, so a full hit leaves nothing to compute."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_133 import hash_chain, longest_cached_prefix  # noqa: E402,F401
from nano_engine.paged import hash_block  # noqa: E402

EXPECTED_HINT = "never the block holding the last token"


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):  # noqa: F811
    blocks = []
    for h in hash_chain(token_ids, block_size, cache_salt):  # MUTANT: no (len - 1) // block_size limit
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks
