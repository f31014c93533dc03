"""Mutant of exercise 129: an admitted request is given its prompt, not all it is behind (a preempted one has outputs too)."""

EXPECTED_HINT = "a preempted request is behind by its prompt and the outputs it had"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402

from nano_engine.request import RequestStatus  # noqa: E402
from nano_engine.scheduler import ScheduledChunk  # noqa: E402


class Scheduler(Model):
    def waiting_pass(self, out, budget):
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.next_waiting()
            n = req.num_prompt_tokens - req.num_computed  # MUTANT: req.num_behind
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.allocate_slots(req, req.num_computed + n):
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.chunks.append(ScheduledChunk(req, req.num_computed, n, req.chunk_kind(req.num_computed)))
            budget -= n
        return budget
