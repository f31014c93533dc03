"""Mutant of exercise 129: puts a preempted request at the back of the waiting queue."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def preempt(self, req):
        super().preempt(req)
        self.waiting.remove(req)
        self.waiting.append(req)  # MUTANT: appendleft
