"""Mutant of exercise 130: aging decides who is admitted, but the victim is chosen by the raw priority."""

EXPECTED_HINT = "the victim should be the running request with the largest key"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def select_victim(self):
        return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.seq))  # MUTANT: self.priority_key
