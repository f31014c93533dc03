"""Mutant of exercise 127: touch takes a free block out of the free queue only when it holds a cached
prefix (the usual prefix-cache hit); a free block without one stays in the queue while it is held."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "whether it holds a prefix or not, must leave the free queue"


class BlockPool(Model):
    def touch(self, block_ids):
        for b in block_ids:
            if self.ref_count[b] == 0 and self.block_hash[b] is not None:  # MUTANT: named blocks only
                del self.free_queue[b]
            self.ref_count[b] += 1
