"""Mutant of exercise 127: free reverses the blocks it is given, as if the scheduler had not already."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "freed blocks that hold a prefix join the END in the order given"


class BlockPool(Model):
    def free(self, block_ids):
        for b in reversed(list(block_ids)):  # MUTANT: "tail first", but the caller already reversed them
            if self.ref_count[b] == 0:
                raise RuntimeError(f"block {b} is already free")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)
