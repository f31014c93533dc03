"""Mutant of exercise 129: when the pool is short, allocate_slots takes the blocks there are, then returns False."""

EXPECTED_HINT = "takes all the blocks it needs or none"

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def allocate_slots(self, req, num_tokens):
        need = math.ceil(num_tokens / self.block_size) - len(req.block_ids)
        take = min(need, self.pool.num_free)
        if take > 0:
            req.block_ids += self.pool.allocate(take)  # MUTANT: all or nothing
        return take >= need
