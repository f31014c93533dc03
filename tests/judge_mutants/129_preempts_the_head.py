"""Mutant of exercise 129: preempts the head of the running queue instead of the tail."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def select_victim(self):
        return self.running[0]  # MUTANT: the oldest, not the most recently admitted
