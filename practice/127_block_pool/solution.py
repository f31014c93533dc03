"""Exercise 127: the KV block pool, with reference counts. Edit this file, then run

    python practice/judge.py 127

Implement the four members below; the statement is in README.md. Everything else comes from
nano_engine's BlockPool, which this class extends. Its __init__ sets up:

  self.num_blocks   blocks 0 .. num_blocks - 1
  self.ref_count    a list: how many requests hold each block (0 = free)
  self.free_queue   an OrderedDict whose keys are the free blocks, in the order they will be handed
                    out: next(iter(q)) is the next one, q.popitem(last=False) takes it,
                    q[b] = None puts b at the end, q.move_to_end(b, last=False) at the front,
                    del q[b] takes b out from anywhere
  self.block_hash   a list: the name of the prefix a block holds, or None (prefix caching)
  self.cached       a dict: prefix name -> the block holding it

and gives `lookup(hashes)` and `cache_blocks(...)`, the prefix cache, which this exercise uses but
does not change. The scheduler calls allocate, free (with a request's blocks in reverse) and touch.
"""

from typing import Iterable

from nano_engine.paged import BlockPool as BaseBlockPool


class BlockPool(BaseBlockPool):
    @property
    def num_free(self) -> int:
        """How many blocks allocate can hand out now: the blocks in the free queue."""
        raise NotImplementedError

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the FRONT of the free queue (least recently freed first); return their ids.

        Each gets reference count 1. A block may still hold a cached prefix (self.block_hash[b] is
        not None): it is about to be overwritten, so forget it (del self.cached[self.block_hash[b]];
        self.block_hash[b] = None). If fewer than n blocks are free, raise ValueError and take none.
        """
        raise NotImplementedError

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given (an iterable: it may be reversed(...)).

        A block whose count drops to 0 rejoins the free queue, where depends on what it holds:
        - it holds a cached prefix (self.block_hash[b] is not None): at the END, keeping its prefix
          until allocate reuses it;
        - it holds none: at the FRONT (reusing it loses nothing), in the order given: the first of
          them is handed out first (q.move_to_end(b, last=False) puts b at the front).
        A call that would drop a block below 0 (already free, or named more often than it is held)
        raises RuntimeError and changes nothing: check the whole call first.
        """
        raise NotImplementedError

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit shares it).

        A block that was free (count 0) leaves the free queue: someone uses it again.
        """
        raise NotImplementedError
