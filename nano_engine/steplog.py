"""The engine's step log: one small record per step, and the queues replayed from it.

A server runs one engine for days, so a record holds only what happened in its step (who got
how many tokens, who was preempted, added, finished or aborted) and the queue lengths as ints,
never copies of the queues: with 500 requests waiting, copying the queues cost 5 KB per step.
`queue_states` rebuilds the waiting and running queues at the end of every step by replaying
these events, which is what the timelines and the chapters' step tables need. The engine keeps
the most recent `EngineConfig.step_log_size` records (a deque); totals live in `EngineStats`.

vLLM logs the same facts as counters (`vllm/v1/metrics/stats.py`: SchedulerStats, IterationStats)
and per-request events (`vllm/v1/engine/__init__.py`: EngineCoreEvent QUEUED, SCHEDULED, PREEMPTED).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class StepRecord:
    step: int  # the engine's step number (idle steps are counted but not recorded)
    start: float  # seconds since the engine was created
    duration: float  # seconds
    scheduled: list[tuple[str, int, str]]  # (request_id, tokens, "prefill" | "decode" | "verify" | "recompute")
    preempted: list[str]  # in preemption order; each went to the front of the waiting queue
    finished: list[str]  # finished in this step: "stop", "length", or "error"
    num_free_blocks: int  # at the end of the step
    num_waiting: int  # at the end of the step
    num_running: int  # at the end of the step (some may have got no tokens in it)
    num_sampled: int = 0  # rows that sampled a token (the LM head ran on these only)
    added: list[str] = field(default_factory=list)  # queued since the previous record
    aborted: list[str] = field(default_factory=list)  # aborted since the previous record
    # Speculative decoding: (request_id, drafts verified, drafts kept) of each "verify" chunk
    drafts: list[tuple[str, int, int]] = field(default_factory=list)
    error: str | None = None  # what this step raised; its requests finished with "error"

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens that are not decodes: prompt chunks and recomputed ones."""
        return sum(n for _, n, kind in self.scheduled if kind != "decode")

    @property
    def num_requests(self) -> int:
        return len(self.scheduled)

    def __getattr__(self, name: str):
        # Only reached for missing attributes: say where the old per-step queue copies went.
        if name in ("waiting_ids", "running_ids"):
            raise AttributeError(f"StepRecord.{name} is gone (it copied the whole queue every step): use "
                                 f"nano_engine.steplog.queue_states(engine.step_log)[i].{name[:-4]}")
        raise AttributeError(name)


@dataclass
class Queues:
    waiting: list[str]  # in queue order, front first
    running: list[str]  # in the running queue's order


def queue_states(log: Iterable[StepRecord]) -> list[Queues]:
    """The waiting and running request ids at the end of each step of `log`, replayed from its events.

    Replays what the scheduler does: added requests join the back of the waiting queue, a victim
    leaves the running queue for the front of the waiting queue, a request scheduled while not
    running is admitted (it joins the back of the running queue), finished and aborted ones
    leave. Exact for a log that starts at the engine's first step; for a log cut by
    `step_log_size`, requests that were queued before its first record appear once they act.
    """
    waiting: list[str] = []
    running: list[str] = []
    out = []
    for rec in log:
        gone = set(rec.aborted)
        waiting = [r for r in waiting if r not in gone] + list(rec.added)
        running = [r for r in running if r not in gone]
        for rid in rec.preempted:
            if rid in running:
                running.remove(rid)
            waiting.insert(0, rid)
        live = set(running)
        for rid, _, _ in rec.scheduled:
            if rid not in live:
                if rid in waiting:
                    waiting.remove(rid)
                running.append(rid)
                live.add(rid)
        gone = set(rec.finished)
        waiting = [r for r in waiting if r not in gone]
        running = [r for r in running if r not in gone]
        out.append(Queues(list(waiting), list(running)))
    return out


@dataclass
class EngineStats:
    steps: int = 0  # every call of step(), idle ones included
    preemptions: int = 0
    tokens: int = 0  # tokens processed by the model
    recomputed_tokens: int = 0
    seconds: float = 0.0
    num_finished: int = 0  # requests finished by a step (stop, length or error); aborts not included
    num_errors: int = 0  # steps that raised
    # Speculative decoding (vLLM's spec_decode metrics): verifications with drafts, drafts checked,
    # drafts kept, and drafts kept by position (index 0: the first draft of a step)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
