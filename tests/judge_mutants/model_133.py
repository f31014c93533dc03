"""A learner-style solution of exercise 133, written from the statement alone: it passes every case.

The mutants next to it (133_*.py) change one thing each.
"""

from nano_engine.paged import hash_block


def hash_chain(token_ids, block_size, cache_salt=None):
    hashes = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = b""
        if start == 0 and cache_salt is not None:
            extra = b"salt:" + cache_salt.encode()
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def longest_cached_prefix(token_ids, block_size, cached, cache_salt=None):
    most = (len(token_ids) - 1) // block_size
    blocks = []
    for h in hash_chain(token_ids, block_size, cache_salt)[:most]:
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks
