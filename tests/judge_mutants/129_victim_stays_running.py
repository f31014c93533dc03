"""Mutant of exercise 129: preempt moves the victim to the waiting queue but leaves it marked RUNNING."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def preempt(self, req):
        self.running.remove(req)
        self.free_blocks(req)
        req.recompute_until = max(req.recompute_until, req.num_computed)
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)  # MUTANT: req.status stays RUNNING
