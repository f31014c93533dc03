"""Mutant of exercise 127: every freed block joins the end of the free queue, also one that holds no
prefix, so cached prefixes are evicted before blocks that hold nothing."""

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
                self.free_queue[b] = None  # MUTANT: a block that holds no prefix should go to the front
