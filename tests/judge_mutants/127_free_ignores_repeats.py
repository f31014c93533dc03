"""Mutant of exercise 127: free checks every block before dropping any reference, but against the
counts before the call: a block named twice in one call while held once passes the check, and its
count goes to -1 while it sits in the free queue."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "names a block more often than it is held"


class BlockPool(Model):
    def free(self, block_ids):
        block_ids = list(block_ids)
        for b in block_ids:
            if self.ref_count[b] == 0:  # MUTANT: a repeat within the call is not counted
                raise RuntimeError(f"block {b} is already free")
        front = []
        for b in block_ids:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    front.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
