"""Mutant of exercise 133: both functions return tuples (immutable, "hashes never change"), not lists."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import model_133  # noqa: E402

EXPECTED_HINT = "both functions return a list"


def hash_chain(token_ids, block_size, cache_salt=None):
    return tuple(model_133.hash_chain(token_ids, block_size, cache_salt))  # MUTANT: a tuple


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):
    return tuple(model_133.longest_cached_prefix(token_ids, block_size, cached, cache_salt))  # MUTANT: a tuple
