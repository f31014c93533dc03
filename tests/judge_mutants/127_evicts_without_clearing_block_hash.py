"""Mutant of exercise 127: allocate drops a reused block's prefix from self.cached but leaves its block_hash."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "a reused block must lose its name in block_hash too"


class BlockPool(Model):
    def allocate(self, n):
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} are free")
        ids = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:
                del self.cached[self.block_hash[b]]  # MUTANT: self.block_hash[b] stays set
            self.ref_count[b] = 1
            ids.append(b)
        return ids
