"""Mutant of exercise 130: the key orders by the order requests were added, not by arrival_time."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def priority_key(self, req):
        effective = req.priority - self.config.priority_aging * self.steps_waited(req)
        return (effective, req.seq)  # MUTANT: no arrival_time
