"""Mutant of exercise 127: free ignores other holders, so a shared block is freed while still in use."""

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
            self.ref_count[b] = 0  # MUTANT: should drop one reference, and free only at 0
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    front.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
