"""Mutant of exercise 130: ignores priority_aging: an old request starves behind a stream of urgent ones."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def priority_key(self, req):
        return (req.priority, req.arrival_time, req.seq)  # MUTANT: no aging
