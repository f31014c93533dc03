"""Mutant of exercise 129: a waiting request whose blocks cannot be had is skipped, the next one tried."""

EXPECTED_HINT = "admission stops at the first waiting request whose blocks cannot be had"
EXPECTED_CASE = "admission_stops_at_a_request_whose_blocks"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402

from nano_engine.request import RequestStatus  # noqa: E402
from nano_engine.scheduler import ScheduledChunk  # noqa: E402


class Scheduler(Model):
    def waiting_pass(self, out, budget):
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = req.num_behind
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.allocate_slots(req, req.num_computed + n):
                continue  # MUTANT: break (admission stops)
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.chunks.append(ScheduledChunk(req, req.num_computed, n, req.chunk_kind(req.num_computed)))
            budget -= n
        return budget
