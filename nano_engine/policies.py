"""Scheduling policies besides vLLM's default: small subclasses of `Scheduler` that override its hooks.

`Scheduler.schedule()` (scheduler.py) is the chapter's algorithm, first come first served. Each
policy here changes only the decisions it names:

- "priority" (vLLM's SchedulingPolicy.PRIORITY): the waiting request to admit next and the victim
  are chosen by (priority, arrival) instead of queue order; with `priority_aging` > 0 each step
  waited lowers a request's priority value, so that none starves.
- "conservative" (SGLang's admission and retraction): admit only with headroom for what everyone
  will still write (remaining output x `new_token_ratio`); when memory runs short retract the
  decode with the least output, and re-estimate the ratio. It keeps vLLM's mixed steps (SGLang
  runs prefill-first unless --enable-mixed-chunk).
- "static" (the baseline): a new batch is admitted only when the running one has finished, and
  prompts are never chunked.

`scheduler_class(policy)` gives the class for a `SchedulerConfig.policy`; LLMEngine uses it.

Mirrors vLLM `vllm/v1/core/sched/scheduler.py` (the PRIORITY branches of schedule) and
`vllm/v1/core/sched/request_queue.py` (PriorityRequestQueue); SGLang
`srt/managers/schedule_policy.py` (PrefillAdder), `srt/managers/schedule_batch.py` (retract_decode)
and `srt/managers/scheduler.py` (new_token_ratio).
"""

from __future__ import annotations

from .paged import BlockPool
from .request import Request
from .scheduler import POLICIES, Scheduler, SchedulerConfig, SchedulerOutput


class PriorityScheduler(Scheduler):
    """Serve the most urgent first (smallest priority value), preempt the least urgent."""

    def priority_key(self, req: Request):
        aged = req.priority - self.config.priority_aging * self.steps_waited(req)
        return (aged, req.arrival_time, req.seq)

    def next_waiting(self) -> Request:
        return min(self.waiting, key=self.priority_key)

    def select_victim(self) -> Request:
        return max(self.running, key=self.priority_key)


class ConservativeScheduler(Scheduler):
    """SGLang's admission: keep room for the estimated remaining output of every running request."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int):
        super().__init__(config, block_pool, block_size)
        # Token slots left for admissions in this step, after what the running requests are
        # estimated to still write: recomputed after each running pass, spent by can_admit.
        self.headroom = 0.0

    def select_victim(self) -> Request:
        # retract_decode: the request with the least output loses least, then the longest prompt.
        return min(self.running, key=lambda r: (len(r.output_ids), -r.num_prompt_tokens))

    def reserved_tokens(self, req: Request) -> float:
        """The KV the request is estimated to still need for its output."""
        return (req.sampling_params.max_tokens - len(req.output_ids)) * self.new_token_ratio

    def after_running_pass(self, out: SchedulerOutput) -> None:
        cfg = self.config
        if out.preempted:  # the estimate was too low: start again from what the survivors show
            decoded = sum(len(r.output_ids) for r in self.running)
            max_new = sum(r.sampling_params.max_tokens for r in self.running) or 1
            self.new_token_ratio = min(1.0, (decoded + cfg.retract_decode_steps * len(self.running)) / max_new)
        else:  # no trouble: trust the estimate a little less each step
            self.new_token_ratio = max(cfg.min_new_token_ratio, self.new_token_ratio - cfg.new_token_ratio_decay)
        self.headroom = self.pool.num_free * self.block_size - sum(map(self.reserved_tokens, self.running))

    def can_admit(self, req: Request, n: int) -> bool:
        need = n + self.reserved_tokens(req)
        if self.running and need > self.headroom:
            return False  # no room for what it and the running requests will still write
        self.headroom -= need
        return True


class StaticScheduler(Scheduler):
    """Static batching: the next batch starts only when the whole running batch has finished.
    Prompts are never chunked (SchedulerConfig refuses enable_chunked_prefill=True with it)."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int):
        super().__init__(config, block_pool, block_size)
        self.batch_done = True  # no batch is running: the next may start (set by each running pass)

    def after_running_pass(self, out: SchedulerOutput) -> None:
        self.batch_done = not self.running

    def can_admit(self, req: Request, n: int) -> bool:
        return self.batch_done


POLICY_CLASSES: dict[str, type[Scheduler]] = {
    "fcfs": Scheduler, "priority": PriorityScheduler, "conservative": ConservativeScheduler,
    "static": StaticScheduler,
}
assert tuple(POLICY_CLASSES) == POLICIES


def scheduler_class(policy: str) -> type[Scheduler]:
    """The Scheduler class of a SchedulerConfig.policy (which SchedulerConfig has checked)."""
    return POLICY_CLASSES[policy]
