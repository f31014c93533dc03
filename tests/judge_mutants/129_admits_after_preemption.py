"""Mutant of exercise 129: admits waiting requests in a step that preempted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402
from nano_engine.scheduler import SchedulerOutput  # noqa: E402


class Scheduler(Model):
    def schedule(self):
        out = SchedulerOutput()
        budget = self.running_pass(out, self.config.max_num_batched_tokens)
        self.waiting_pass(out, budget)  # MUTANT: even after a preemption
        return out
