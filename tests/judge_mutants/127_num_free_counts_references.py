"""Mutant of exercise 127: num_free is the number of blocks less the references held, so a block shared
by two requests counts twice (and num_free can go negative)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "num_free is the number of blocks in the free queue"


class BlockPool(Model):
    @property
    def num_free(self):
        return self.num_blocks - sum(self.ref_count)  # MUTANT: references, not held blocks
