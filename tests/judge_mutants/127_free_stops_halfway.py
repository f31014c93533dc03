"""Mutant of exercise 127: free raises at the first block already free, but only after dropping the
references of the blocks before it, and the blocks without a prefix that it freed never reach the
free queue: a refused call loses blocks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "a free that raises must change nothing"


class BlockPool(Model):
    def free(self, block_ids):
        front = []
        for b in block_ids:
            if self.ref_count[b] == 0:  # MUTANT: checked as it goes; what came before is already done
                raise RuntimeError(f"block {b} is already free")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    front.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
