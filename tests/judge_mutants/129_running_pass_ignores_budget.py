"""Mutant of exercise 129: gives each running request all it is behind, whatever the budget."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402
from nano_engine.scheduler import ScheduledChunk  # noqa: E402


class Scheduler(Model):
    def running_pass(self, out, budget):
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_behind  # MUTANT: min(req.num_behind, budget)
            while not self.allocate_slots(req, req.num_computed + n):
                victim = self.select_victim()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.chunks.append(ScheduledChunk(req, req.num_computed, n, req.chunk_kind(req.num_computed)))
            budget -= n
            i += 1
        return budget
