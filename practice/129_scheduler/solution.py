"""Exercise 129: the continuous batching scheduler. Edit this file, then run

    python practice/judge.py 129

Implement the three methods below; the statement is in README.md. Everything else comes from
nano_engine's Scheduler, which this class extends: the queues `self.waiting` (a deque, front =
next) and `self.running` (a list, in admission order), `self.config` (max_num_batched_tokens,
max_num_seqs, enable_chunked_prefill), `self.pool` (a BlockPool: `num_free`, `allocate(n)`),
`self.block_size`, `self.free_blocks(req)`, `self.select_victim()` (the tail of the running queue)
and `self.next_waiting()` (the head of the waiting queue).

A request (nano_engine.request.Request) has `num_computed` (tokens whose KV is cached),
`num_tokens` (prompt + output), `num_behind` (their difference), `block_ids` (its block table),
`status`, `num_preemptions`, `recompute_until` and `chunk_kind(start)`.
Prefix caching is off in every case of this exercise: an admitted request starts at token 0.
"""

import math  # math.ceil, for allocate_slots

from nano_engine.request import Request, RequestStatus  # RequestStatus.WAITING / RUNNING
from nano_engine.scheduler import ScheduledChunk, SchedulerOutput
from nano_engine.scheduler import Scheduler as BaseScheduler


class Scheduler(BaseScheduler):
    def allocate_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow req.block_ids so that it holds num_tokens tokens (ceil(num_tokens / block_size) blocks).

        Take the missing blocks from self.pool. If it has too few free blocks, take none and return
        False; otherwise return True.
        """
        raise NotImplementedError

    def preempt(self, req: Request) -> None:
        """Recompute preemption of a running request.

        Remove it from the running queue, free all its blocks (self.free_blocks), remember how far
        its KV went (req.recompute_until = max(req.recompute_until, req.num_computed)), set
        num_computed to 0, count the preemption, set its status to WAITING and put it at the FRONT
        of the waiting queue.
        """
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        """One step: hand out at most max_num_batched_tokens tokens. Return a SchedulerOutput.

        1. The running requests, in queue order, while budget is left: n = min(req.num_behind,
           budget left); make room with self.allocate_slots(req, req.num_computed + n). While that
           fails, preempt self.select_victim() and record it in out.preempted; if the victim is
           req itself, the running pass ends. Otherwise add ScheduledChunk(req, req.num_computed,
           n, req.chunk_kind(req.num_computed)) to out.chunks.
        2. The waiting requests, only if nobody was preempted in this step, while budget is left
           and fewer than max_num_seqs requests run: req = self.next_waiting(); n = req.num_behind;
           without chunked prefill a request that does not fit the budget left waits (and so does
           everyone behind it); n = min(n, budget left); allocate its blocks or stop admitting;
           move it from waiting to running (status RUNNING) and schedule its chunk.
        """
        raise NotImplementedError
