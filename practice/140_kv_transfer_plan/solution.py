"""Exercise 140: the plan that moves a prompt's KV between engines of different block sizes. Edit
this file, then run

    python practice/judge.py 140

The statement is in README.md. A block table is a list of block ids; token p of a request lies in
slot table[p // block_size] * block_size + p % block_size of its engine's KV cache. Return a list
of (src_slot, dst_slot, length) tuples of ints. Leave the block tables unchanged.
"""

from typing import Sequence


def transfer_plan(src_blocks: Sequence[int], src_block_size: int, dst_blocks: Sequence[int], dst_block_size: int,
                  start: int, end: int) -> list[tuple[int, int, int]]:
    """The copies that move tokens start .. end - 1 from the source's slots to the destination's:
    runs in token order, each as long as both sides' slots stay consecutive."""
    raise NotImplementedError
