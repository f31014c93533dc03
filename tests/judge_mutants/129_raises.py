"""Mutant of exercise 129: a typo that raises AttributeError in the running pass."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def running_pass(self, out, budget):
        for req in self.running:
            budget -= req.num_behnd  # MUTANT: a typo
        return budget
