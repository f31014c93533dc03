"""Mutant of exercise 129: allocate_slots takes one block more than the tokens need."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def allocate_slots(self, req, num_tokens):
        need = num_tokens // self.block_size + 1 - len(req.block_ids)  # MUTANT: not ceil division
        if need > self.pool.num_free:
            return False
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True
