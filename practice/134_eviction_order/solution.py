"""Exercise 134: eviction order and reference counts of whole requests. Edit this file, then run

    python practice/judge.py 134

The statement is in README.md. `pool` is nano_engine's BlockPool (exercise 127's, finished); use
its methods and read its state:

  pool.lookup(hashes)     the blocks holding the longest cached prefix with these hashes
  pool.touch(block_ids)   one more reference to each block; a free one leaves the free queue
  pool.allocate(n)        n blocks from the FRONT of the free queue (raises ValueError if fewer are free)
  pool.free(block_ids)    one reference less to each, in the order given; a block nobody holds
                          rejoins the free queue (at the END if it holds a cached prefix, else at the FRONT)
  pool.num_free           the number of blocks in the free queue
  pool.ref_count[b]       the holders of block b (0 = free)
"""


def admit(pool, hashes: list[bytes], num_blocks: int) -> list[int] | None:
    """The block table of a new request, or None (and the pool unchanged) if it cannot have it now.

    hashes: the chained hashes of the request's blocks that may hit (the block holding its last
    token is never among them). num_blocks: the blocks its tokens need. The table is the hit
    blocks (shared: one more reference each), then num_blocks - len(hit) new blocks.
    """
    raise NotImplementedError


def release(pool, block_ids: list[int]) -> None:
    """Give back a request's blocks (it finished, or it is preempted): one reference to each."""
    raise NotImplementedError
