"""Mutant of exercise 127: every freed block goes to the front of the free queue, also one that holds a
cached prefix, so cached prefixes are evicted first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402


class BlockPool(Model):
    def free(self, block_ids):
        front = []
        for b in block_ids:
            if self.ref_count[b] == 0:
                raise RuntimeError(f"block {b} is already free")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                front.append(b)  # MUTANT: a block that holds a prefix should join the end
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
