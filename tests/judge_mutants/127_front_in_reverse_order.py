"""Mutant of exercise 127: blocks that hold no prefix go to the front one by one as they come, so they
end up in reverse order (the last one given is handed out first)."""

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
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)  # MUTANT: the first given should end up first
