"""Mutant of exercise 130: serves the largest priority value first (it reads priority as importance)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def priority_key(self, req):
        effective = -req.priority - self.config.priority_aging * self.steps_waited(req)  # MUTANT: -priority
        return (effective, req.arrival_time, req.seq)
