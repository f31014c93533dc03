"""Mutant of exercise 130: the aging is rounded down to whole priority levels."""

EXPECTED_HINT = "with priority_aging=0.5 every step waited lowers the priority value by 0.5"

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def priority_key(self, req):
        aged = req.priority - math.floor(self.config.priority_aging * self.steps_waited(req))  # MUTANT: no floor
        return (aged, req.arrival_time, req.seq)
