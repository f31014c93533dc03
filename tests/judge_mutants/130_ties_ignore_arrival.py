"""Mutant of exercise 130: the key has no arrival: ties fall to queue order."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def priority_key(self, req):
        return req.priority - self.config.priority_aging * self.steps_waited(req)  # MUTANT: no arrival
