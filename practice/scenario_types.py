"""The data of a scheduler scenario (practice/scenarios.py plays it, practice/hints.py explains a
difference): the requests that arrive, the settings, and what one step recorded."""

from __future__ import annotations

import functools
import textwrap
from dataclasses import dataclass, field

from nano_engine import SchedulerConfig


@dataclass(frozen=True)
class Arrival:
    rid: str
    prompt_len: int
    max_tokens: int = 4
    step: int = 0  # added just before this step's schedule()
    priority: int = 0
    arrival_time: float | None = None  # the request's arrival_time; None: its arrival order (seq)

    def time(self, seq: int) -> float:
        return float(seq) if self.arrival_time is None else self.arrival_time


@dataclass
class Scenario:
    arrivals: list[Arrival]  # in arrival order
    num_blocks: int = 64
    block_size: int = 4
    settings: dict = field(default_factory=dict)  # SchedulerConfig fields
    label: str = ""  # a first line for the report (which random scenario)

    @functools.cached_property
    def config(self) -> SchedulerConfig:  # settings do not change once a scenario is made
        return SchedulerConfig(**self.settings)

    def arrival(self, rid: str) -> tuple[int, Arrival]:
        return next((i, a) for i, a in enumerate(self.arrivals) if a.rid == rid)

    def key(self, rid: str, step: int) -> tuple[float, float, int]:
        """The priority policy's key at this step: (priority - aging x steps waited, arrival_time, seq)."""
        seq, a = self.arrival(rid)
        return (a.priority - self.config.priority_aging * (step - a.step), a.time(seq), seq)

    def describe(self) -> list[str]:
        c, prio = self.config, self.config.policy == "priority"
        head = (f"scenario: budget {c.max_num_batched_tokens}, max_num_seqs {c.max_num_seqs}, "
                f"{self.num_blocks} KV blocks of {self.block_size} tokens")
        head += "" if c.enable_chunked_prefill else ", chunked prefill off"
        head += f", priority_aging {c.priority_aging:g}" if prio else ""
        reqs = "; ".join(f"{a.rid}: prompt {a.prompt_len}, max_tokens {a.max_tokens}"
                         + (f", arrives at step {a.step}" if a.step else "")
                         + (f", priority {a.priority}" if prio else "")
                         + (f", arrival_time {a.arrival_time:g}" if a.arrival_time is not None else "")
                         for a in self.arrivals)
        return ([self.label] if self.label else []) + [head] + textwrap.wrap("requests: " + reqs, 100,
                                                                             subsequent_indent="  ")


@dataclass
class Step:
    index: int
    before: str  # the queues before scheduling, for the report
    running_before: list[str]
    waiting_before: list[str]
    behind: dict[str, int]  # tokens behind, before scheduling
    scheduled: list[tuple[str, int, str]] = field(default_factory=list)  # (request, tokens, kind)
    preempted: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # after scheduling
    waiting: list[str] = field(default_factory=list)
    free: int = 0  # free KV blocks after scheduling
    states: dict[str, tuple] = field(default_factory=dict)  # request -> hints.STATE_FIELDS, after scheduling
    problem: str | None = None  # an impossible decision; the play stops there
