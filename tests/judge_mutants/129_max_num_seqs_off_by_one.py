"""Mutant of exercise 129: admits while at most max_num_seqs run, one request too many."""

EXPECTED_HINT = "more than max_num_seqs requests running"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402

from nano_engine.request import RequestStatus  # noqa: E402
from nano_engine.scheduler import ScheduledChunk  # noqa: E402


class Scheduler(Model):
    def waiting_pass(self, out, budget):
        while self.waiting and budget > 0 and len(self.running) <= self.config.max_num_seqs:  # MUTANT: <
            req = self.next_waiting()
            n = req.num_behind
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
