"""Mutant of exercise 130: keeps FCFS's victim, the tail of the running queue, whatever the priorities."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def select_victim(self):
        return self.running[-1]  # MUTANT
