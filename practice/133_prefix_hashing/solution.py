"""Exercise 133: the hash chain and the longest cached prefix. Edit this file, then run

    python practice/judge.py 133

The statement is in README.md. Hash each block with nano_engine's own hash_block, so that your
hashes are the engine's:

    hash_block(parent, tokens, extra=b"") -> bytes
        parent  the hash of the block before (None for the first block)
        tokens  the block's token ids
        extra   extra keys (bytes); the salt goes here, in the first block only

The judge plugs your two functions into the scheduler and into the engine: your hashes name the
blocks the engine computes, and your lookup decides where each admitted request starts.
"""

from nano_engine.paged import hash_block  # noqa: F401  (you will need it)


def hash_chain(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of the FULL blocks of token_ids, block 0 first.

    Block i holds token_ids[i * block_size:(i + 1) * block_size]; its parent is block i - 1's hash
    (None for block 0). A cache_salt (None or a non-empty str) is the extra key
    b"salt:" + cache_salt.encode() of block 0 only. A partial last block has no hash.
    """
    raise NotImplementedError


def longest_cached_prefix(token_ids: list[int], block_size: int, cached: dict[bytes, int],
                          cache_salt: str | None = None) -> list[int]:
    """The block ids of the longest run of cached blocks from the start of token_ids.

    cached maps a block's hash to the id of the block that holds it. Take the hashes of
    hash_chain(...) in order while each is in cached, at most (len(token_ids) - 1) // block_size of
    them: the block holding the last token is never a hit, so at least that token is computed.
    """
    raise NotImplementedError
