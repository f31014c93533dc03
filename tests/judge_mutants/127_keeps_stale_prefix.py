"""Mutant of exercise 127: allocate reuses a block without forgetting the prefix it held."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402


class BlockPool(Model):
    def allocate(self, n):
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} are free")
        ids = [self.free_queue.popitem(last=False)[0] for _ in range(n)]  # MUTANT: no eviction
        for b in ids:
            self.ref_count[b] = 1
        return ids
