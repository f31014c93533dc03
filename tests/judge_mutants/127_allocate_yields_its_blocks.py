"""Mutant of exercise 127: allocate is a generator: it yields the blocks instead of returning their list."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "allocate returns the list of the blocks it took"


class BlockPool(Model):
    def allocate(self, n):
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} are free")
        for _ in range(n):  # MUTANT: yield, not a list (and nothing is taken until someone iterates)
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            yield b
