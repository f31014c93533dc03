"""Mutant of exercise 129: admits after a preemption when the budget is large (above every scripted one)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402
from nano_engine.scheduler import SchedulerOutput  # noqa: E402


class Scheduler(Model):
    def schedule(self):
        out = SchedulerOutput()
        budget = self.running_pass(out, self.config.max_num_batched_tokens)
        if not out.preempted or self.config.max_num_batched_tokens > 100:  # MUTANT: "plenty of budget"
            self.waiting_pass(out, budget)
        return out
