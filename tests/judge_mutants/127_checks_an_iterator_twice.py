"""Mutant of exercise 127: free checks every block first (so that a double free changes nothing), then
frees them in a second loop over the same argument; given reversed(...), an iterator, the second loop
finds it used up and frees nothing."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "make a list of it first"


class BlockPool(Model):
    def free(self, block_ids):
        for b in block_ids:  # check first: a double free raises before anything changes
            if self.ref_count[b] == 0:
                raise RuntimeError(f"block {b} is already free")
        front = []
        for b in block_ids:  # MUTANT: an iterator is used up by the loop above
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    front.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(front):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)
