"""Mutant of exercise 127: a freed block goes to the front of the free queue, so it is reused first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402


class BlockPool(Model):
    def free(self, block_ids):
        for b in block_ids:
            if self.ref_count[b] == 0:
                raise RuntimeError(f"block {b} is already free")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_queue[b] = None
                self.free_queue.move_to_end(b, last=False)  # MUTANT: should stay at the end
