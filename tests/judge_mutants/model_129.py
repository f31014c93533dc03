"""A learner-style solution of exercise 129, written from the statement alone: it passes every case.

The mutants next to it subclass it and break one thing each.
"""

import math

from nano_engine.request import RequestStatus
from nano_engine.scheduler import ScheduledChunk, SchedulerOutput
from nano_engine.scheduler import Scheduler as BaseScheduler


class Scheduler(BaseScheduler):
    def allocate_slots(self, req, num_tokens):
        need = math.ceil(num_tokens / self.block_size) - len(req.block_ids)
        if need > self.pool.num_free:
            return False
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def preempt(self, req):
        self.running.remove(req)
        self.free_blocks(req)
        req.recompute_until = max(req.recompute_until, req.num_computed)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def schedule(self):
        out = SchedulerOutput()
        budget = self.running_pass(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self.waiting_pass(out, budget)
        return out

    def running_pass(self, out, budget):
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_behind, budget)
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

    def waiting_pass(self, out, budget):
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
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
