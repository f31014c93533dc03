"""Mutant of exercise 127: touch counts the reference but leaves a free block in the free queue."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402


class BlockPool(Model):
    def touch(self, block_ids):
        for b in block_ids:
            self.ref_count[b] += 1  # MUTANT: a free block should leave the free queue
