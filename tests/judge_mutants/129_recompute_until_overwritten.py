"""Mutant of exercise 129: a second preemption overwrites recompute_until with a smaller num_computed."""

EXPECTED_HINT = "max(req.recompute_until, req.num_computed)"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402

from nano_engine.request import RequestStatus  # noqa: E402


class Scheduler(Model):
    def preempt(self, req):
        self.running.remove(req)
        self.free_blocks(req)
        req.recompute_until = req.num_computed  # MUTANT: max(req.recompute_until, req.num_computed)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
