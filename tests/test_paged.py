"""BlockPool: reference counts, the free queue's eviction order, prefix caching; PagedKVCache."""

import hashlib

import pytest
import torch

from nano_engine.paged import BlockPool, PagedKVCache, block_hashes, hash_block
from nano_engine.runner import slots_of


def test_allocate_and_free_with_reference_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and sorted(a) == [0, 1, 2]
    pool.touch([a[0]])  # a second holder
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_count[a[0]] == 1
    pool.free([a[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])
    # A call that names a block more often than it is held changes nothing, not even the blocks before it
    b = pool.allocate(2)
    for bad in ([b[0], b[1], b[1]], [b[0], a[0]]):
        with pytest.raises(RuntimeError, match=f"block {bad[-1]} freed more often"):
            pool.free(iter(bad))
        assert pool.num_free == 2 and [pool.ref_count[x] for x in b] == [1, 1]
        pool.check()
    pool.free(reversed(b))
    with pytest.raises(ValueError, match="only 4 free"):
        pool.allocate(5)
    pool.check()


def test_hash_block_is_the_recipe_chapter_5_builds_by_hand():
    """16-byte BLAKE2b over the parent's name (b"root" for the first block), the tokens as decimal
    text joined by commas, then "|" and the extra keys if there are any. Chapter 5.1 and exercise 133
    rebuild names this way, and a name without extra keys must not depend on how "none" is said."""
    def by_hand(parent, tokens, extra=b""):
        h = hashlib.blake2b(parent or b"root", digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens))
        if extra:
            h.update(b"|" + extra)
        return h.digest()

    first = hash_block(None, [1, 23, 4])
    assert len(first) == 16 and first == by_hand(None, [1, 23, 4]) == hash_block(None, [1, 23, 4], b"")
    assert hash_block(first, [5, 6], b"salt:x") == by_hand(first, [5, 6], b"salt:x")
    assert hash_block(None, [1, 23, 4]) != hash_block(None, [12, 3, 4])  # the separator keeps tokens apart
    assert block_hashes([1, 23, 4, 5, 6, 7, 8], 3) == [first, by_hand(first, [5, 6, 7])]  # a partial block: no name
    # A cache salt is the first block's extra key "salt:<salt>" (chapter 5.1's my_block_hashes);
    # later blocks carry it through the chain alone.
    salted = by_hand(None, [1, 23, 4], b"salt:tenant-a")
    assert block_hashes([1, 23, 4, 5, 6, 7], 3, cache_salt="tenant-a") == [salted, by_hand(salted, [5, 6, 7])]


def test_cache_blocks_names_exactly_the_blocks_from_start_that_are_not_named_yet():
    # "Register full blocks block_ids[start:len(hashes)]": blocks before `start` are left as they
    # are, a block that already has a name keeps it, and the blocks after it are still named.
    pool = BlockPool(6)
    ids = pool.allocate(4)
    h = block_hashes(list(range(8)), 2)
    pool.cache_blocks(ids, h, start=2)
    assert [pool.block_hash[b] for b in ids] == [None, None, h[2], h[3]]
    other = block_hashes([7, 7, 7, 7], 2)
    pool.cache_blocks(ids[:1], other[:1])  # block 0 named by another prompt first
    pool.cache_blocks(ids, h[:2])
    assert pool.block_hash[ids[0]] == other[0] and pool.block_hash[ids[1]] == h[1]
    assert pool.lookup(h) == [] and pool.lookup(other[:1]) == ids[:1]
    pool.check()


def test_prefix_cache_lookup_touch_and_lru_eviction():
    pool = BlockPool(4)
    a = pool.allocate(2)
    ha = block_hashes([1, 2, 3, 4], 2)
    pool.cache_blocks(a, ha)
    pool.free(list(reversed(a)))  # freed, still cached
    assert pool.num_free == 4 and pool.lookup(ha) == a
    assert pool.lookup(block_hashes([1, 2, 9, 9], 2)) == a[:1]
    pool.touch(pool.lookup(ha))  # a hit takes the blocks back out of the free queue
    assert pool.num_free == 2 and pool.ref_count[a[0]] == 1
    pool.free(list(reversed(a)))
    # Never-used blocks come first, then the cached ones, tail block of the request first.
    got = pool.allocate(3)
    assert got[:2] == [2, 3] and got[2] == a[1]
    assert pool.lookup(ha) == a[:1]  # a[1] was evicted, a[0] is still cached
    pool.check()


def test_prefix_caching_off_finds_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    b = pool.allocate(1)
    h = block_hashes([1, 2], 2)
    pool.cache_blocks(b, h)
    assert pool.lookup(h) == []


def test_paged_cache_slots():
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3)
    assert cache.k[0].shape == cache.v[0].shape == (8, 1, 3)
    slots = slots_of([3, 0], 1, 4, 2)  # positions 1, 2, 3 of a sequence with blocks [3, 0]
    assert slots.tolist() == [7, 0, 1]
    # Slots index rows with index_copy_, which takes int64 only, also for an empty chunk.
    assert slots.dtype == slots_of([], 0, 0, 2).dtype == torch.long
    k = torch.arange(9.0).view(3, 1, 3)
    cache.write(0, slots, k, -k)
    assert torch.equal(cache.k[0][7], k[0]) and torch.equal(cache.v[0][1], -k[2])
    assert cache.nbytes == 2 * 4 * 2 * 3 * 4


def test_freed_blocks_without_a_prefix_are_reused_before_anything_else():
    """vLLM's block_pool.py: a freed block that names no prefix goes to the FRONT of the free queue
    (nothing is lost by reusing it), a named one to the back, so cached prefixes are evicted last."""
    pool = BlockPool(6)
    a = pool.allocate(3)  # a request: two full blocks, named, and a partial tail block
    pool.cache_blocks(a, block_hashes([1, 2, 3, 4, 5], 2))
    b = pool.allocate(2)  # another request, nothing cached
    pool.free(reversed(a))
    assert list(pool.free_queue) == [a[2], 5, a[1], a[0]]  # the tail first, never-used next, prefixes last
    pool.free(reversed(b))
    assert list(pool.free_queue) == [b[1], b[0], a[2], 5, a[1], a[0]]  # in the order given, ahead of all
    assert pool.allocate(4) == [b[1], b[0], a[2], 5]
    assert pool.lookup(block_hashes([1, 2, 3, 4], 2)) == a[:2]  # the prefix outlived four allocations
    pool.check()


def test_a_pool_of_one_block_works_and_of_none_is_refused_by_name():
    assert BlockPool(1).allocate(1) == [0]
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0)
