"""The scheduler: one token budget per step, chunked prefill, preemption by recompute.

There is no prefill phase and no decode phase. Each request is behind by `num_tokens - num_computed`
tokens: a new request by its prompt, a decoding one by 1, a preempted one by everything it had.
Each step hands out at most `max_num_batched_tokens` tokens so that requests catch up:

1. First the running requests, in the running queue's order (they already hold KV). Each gets
   min(behind, budget left) tokens and the blocks to hold them. When blocks run out, preempt a
   victim (the tail of the running queue, the most recently admitted): free its blocks, set
   num_computed to 0, put it at the front of the waiting queue. If the victim is the request
   being scheduled, it gets nothing, and the pass ends (it was the tail).
2. Then the waiting requests, but only if nothing was preempted in this step (memory is short:
   admitting more would thrash), while budget is left and fewer than `max_num_seqs` run. A
   request starts from its longest prefix-cache hit; without chunked prefill one that does not
   fit the budget waits; one whose blocks cannot all be had waits (its hit untouched).

`Scheduler` is this algorithm only (vLLM's default policy, fcfs), to be read next to the chapter's
pseudo-code. Other policies are subclasses in policies.py overriding its hooks (next_waiting,
select_victim, can_admit, after_running_pass); `SchedulerConfig.policy` picks the class.

Mirrors `vllm/v1/core/sched/scheduler.py` (Scheduler.schedule, _preempt_request,
update_from_output) and `vllm/v1/core/kv_cache_manager.py` (get_computed_blocks, allocate_slots).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from . import checks
from .paged import BlockPool, block_hashes
from .request import Request, RequestStatus

POLICIES = ("fcfs", "priority", "conservative", "static")  # their classes: policies.scheduler_class


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 256  # the token budget of one step
    max_num_seqs: int = 16  # requests running at once
    # None: on, but for the static policy, which prefills whole prompts (and refuses True).
    enable_chunked_prefill: bool | None = None
    policy: str = "fcfs"  # one of POLICIES
    priority_aging: float = 0.0  # priority levels gained per step waited ("priority" only)
    init_new_token_ratio: float = 0.7  # SGLang's defaults ("conservative" only)
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    retract_decode_steps: int = 20
    # vLLM's later admission rule (its default since 0.11): admit a waiting request only if blocks
    # for its whole prompt are free, not only for its first chunk. Off: the classic V1 rule taught here.
    scheduler_reserve_full_isl: bool = False

    def __post_init__(self):
        self.max_num_batched_tokens = checks.integer("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        self.max_num_seqs = checks.integer("max_num_seqs", self.max_num_seqs, minimum=1)
        self.policy = checks.choice("policy", self.policy, POLICIES)
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = self.policy != "static"
        self.enable_chunked_prefill = checks.flag("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.policy == "static" and self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=True does not go with policy='static': static batching "
                             "prefills whole prompts (leave it out, or set it False)")
        self.priority_aging = checks.number("priority_aging", self.priority_aging, minimum=0)
        self.init_new_token_ratio = checks.number("init_new_token_ratio", self.init_new_token_ratio,
                                                  minimum=0, maximum=1, exclusive_minimum=True)
        self.min_new_token_ratio = checks.number("min_new_token_ratio", self.min_new_token_ratio,
                                                 minimum=0, maximum=1, exclusive_minimum=True)
        if self.min_new_token_ratio > self.init_new_token_ratio:
            raise ValueError(f"min_new_token_ratio={self.min_new_token_ratio!r} must be <= "
                             f"init_new_token_ratio={self.init_new_token_ratio!r}")
        self.new_token_ratio_decay = checks.number("new_token_ratio_decay", self.new_token_ratio_decay,
                                                   minimum=0, maximum=1)
        self.retract_decode_steps = checks.integer("retract_decode_steps", self.retract_decode_steps, minimum=1)
        self.scheduler_reserve_full_isl = checks.flag("scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # num_computed when scheduled: the chunk is tokens start .. start + n - 1
    n: int
    kind: str  # "prefill", "decode" or "recompute"


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (request, start, end): tokens whose KV the engine loads through its KV connector before the step
    kv_loads: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.n for c in self.chunks)


class Scheduler:
    kv_connector = None  # kv_transfer.py's connector on a consumer engine (LLMEngine sets it)

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int):
        self.config = config
        self.pool = block_pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.new_token_ratio = config.init_new_token_ratio  # SGLang's estimate: only "conservative" moves it
        self._arrival_step: dict[str, int] = {}
        # Prompt tokens looked up in the prefix cache at admission, and those found: vLLM's
        # prefix_cache_queries / prefix_cache_hits (vllm/v1/core/kv_cache_manager.py, PrefixCacheStats).
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    # ----- requests in and out -----
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it could never be scheduled."""
        cfg, bs = self.config, self.block_size
        need = math.ceil(req.max_kv_tokens / bs)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} can never fit: prompt {req.num_prompt_tokens} + max_tokens "
                f"{req.sampling_params.max_tokens} needs {need} blocks of {bs} tokens, the pool has "
                f"{self.pool.num_blocks}")
        if not cfg.enable_chunked_prefill and req.max_kv_tokens > cfg.max_num_batched_tokens:
            # Its largest step: the recompute of everything after a preemption just before its
            # last token. The last sampled token is never fed back, hence the - 1.
            raise ValueError(
                f"request {req.request_id!r} can never be scheduled without chunked prefill: it may need "
                f"prompt {req.num_prompt_tokens} + max_tokens {req.sampling_params.max_tokens} - 1 = "
                f"{req.max_kv_tokens} tokens in one step (a recompute after a preemption), above "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
        self._arrival_step[req.request_id] = self.num_steps
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Finish a request (stop, length or abort) and free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free_blocks(req)
        req.spec_token_ids = []
        self._arrival_step.pop(req.request_id, None)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- blocks -----
    def free_blocks(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))  # tail blocks are evicted first
        req.block_ids = []

    def allocate_slots(self, req: Request, num_tokens: int) -> bool:
        """Grow the block table to hold num_tokens tokens; False (nothing taken) if blocks are short."""
        need = math.ceil(num_tokens / self.block_size) - len(req.block_ids)
        if need > self.pool.num_free:
            return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first num_blocks full blocks (computed once, kept)."""
        if len(req.block_hashes) < num_blocks:
            req.block_hashes = block_hashes(req.all_token_ids, self.block_size, num_blocks, req.cache_salt)
        return req.block_hashes[:num_blocks]

    def preempt(self, req: Request) -> None:
        """Recompute preemption: drop all KV, go back to the front of the waiting queue."""
        self.running.remove(req)
        self.free_blocks(req)
        req.recompute_until = max(req.recompute_until, req.num_computed)
        req.num_computed = 0
        req.spec_token_ids = []  # drafts are proposed again once it decodes
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def steps_waited(self, req: Request) -> int:
        """Steps since the request was added; a preemption does not reset it (aging counts from arrival)."""
        return self.num_steps - self._arrival_step.get(req.request_id, self.num_steps)

    # ----- the policy's hooks: vLLM's fcfs here, the others in policies.py -----
    def priority_key(self, req: Request):
        """Sort key: smaller is served first and preempted last. Under fcfs: arrival order."""
        return (req.arrival_time, req.seq)

    def next_waiting(self) -> Request:
        """The waiting request to admit next: the front of the queue."""
        return self.waiting[0]

    def select_victim(self) -> Request:
        """The running request to preempt when blocks run out: the tail, the most recently admitted."""
        return self.running[-1]

    def can_admit(self, req: Request, n: int) -> bool:
        """Whether to admit `req` with a first chunk of n tokens, before its blocks are taken."""
        return True

    def after_running_pass(self, out: SchedulerOutput) -> None:
        """Called between the running pass and the waiting pass (out holds this step's preemptions)."""

    # ----- one step -----
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledChunk] = {}  # request_id -> its chunk in this step

        # First, the running requests.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_behind, budget)
            while not self.allocate_slots(req, req.num_computed + n):
                victim = self.select_victim()  # the tail; other policies may pick one ahead of req
                if self.running.index(victim) < i:  # ahead of req: req moves up one place
                    i -= 1
                if victim.request_id in scheduled:  # already scheduled in this step: its tokens come back
                    budget += scheduled.pop(victim.request_id).n
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:  # it gets nothing; under fcfs it was the tail, so the pass ends
                    break  # (other policies: the requests after it keep their turn)
            else:
                scheduled[req.request_id] = ScheduledChunk(req, req.num_computed, n, req.chunk_kind(req.num_computed))
                budget -= n
                i += 1
        self.after_running_pass(out)

        # Next, the waiting requests: only in a step that preempted nobody.
        num_admitted = 0
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.next_waiting()
            # The longest cached prefix, in full blocks, leaving at least the last token to compute;
            # none for a request that wants its prompt's logprobs (they need the prompt's logits).
            hit = ([] if req.sampling_params.prompt_logprobs is not None else
                   self.pool.lookup(self.hashes(req, (req.num_tokens - 1) // self.block_size)))
            num_hit = len(hit) * self.block_size
            # Then what a KV connector can load beyond it (kv_transfer.py: disaggregated prefill).
            num_external = (self.kv_connector.get_num_new_matched_tokens(req, num_hit)
                            if self.kv_connector is not None else 0)
            n = req.num_tokens - num_hit - num_external
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.can_admit(req, n):
                break
            # All its blocks must be had before the hit is taken (a hit taken and given back would
            # move to the back of the free queue as if used): those of this chunk, or of its whole
            # prompt under scheduler_reserve_full_isl. Hit blocks that are free leave the free queue
            # when taken, so they count against it too.
            upto = req.num_tokens if cfg.scheduler_reserve_full_isl else num_hit + num_external + n
            need = math.ceil(upto / self.block_size) - len(hit)
            if need + sum(self.pool.ref_count[b] == 0 for b in hit) > self.pool.num_free:
                break
            self.pool.touch(hit)
            req.block_ids, req.num_computed = list(hit), num_hit + num_external
            ok = self.allocate_slots(req, num_hit + num_external + n)
            assert ok, "the blocks were counted before the hit was taken"
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_hit
            if num_external:  # the engine loads them into their blocks before the step runs
                out.kv_loads.append((req, num_hit, num_hit + num_external))
            scheduled[req.request_id] = ScheduledChunk(req, num_hit + num_external, n,
                                                       req.chunk_kind(num_hit + num_external))
            budget -= n
            num_admitted += 1

        out.chunks = list(scheduled.values())
        self.num_steps += 1
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        assert not (out.preempted and num_admitted), "a step that preempted must admit nobody"
        return out
