"""Mutant of exercise 129: preempt does not count the preemption (num_preemptions stays 0)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402
from nano_engine.request import RequestStatus  # noqa: E402


class Scheduler(Model):
    def preempt(self, req):
        self.running.remove(req)
        self.free_blocks(req)
        req.recompute_until = max(req.recompute_until, req.num_computed)
        req.num_computed = 0
        req.status = RequestStatus.WAITING  # MUTANT: no req.num_preemptions += 1
        self.waiting.appendleft(req)
