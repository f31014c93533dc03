"""Mutant of exercise 130: preempts the running request with the smallest key."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def select_victim(self):
        return min(self.running, key=self.priority_key)  # MUTANT: max
