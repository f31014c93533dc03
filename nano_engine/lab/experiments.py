"""The scheduler chapter's identity check and trace, shared by `python -m nano_engine`, the
notebooks and the tests.

Identity: each prompt is generated alone with `mini_llm.generate` (the reference), then all
together through the engine under several scheduling settings; every setting must give the
same tokens, token for token. Scheduling may change when a token is computed, never which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import islice
from typing import Sequence

from ..engine import LLMEngine
from ..mini_llm import Transformer, generate
from ..request import SamplingParams
from ..steplog import StepRecord

CHAT_PROMPTS = [
    "What is a KV cache?",
    "Explain continuous batching in one sentence.",
    "What is Python's GIL?",
    "Write a metaphor about the moon.",
    "Explain tensor parallelism in one sentence.",
    "What is 1+1? Answer directly.",
]

# The three settings of the chapter: defaults; a 32-token budget, which forces chunked prefill;
# a 64-token budget with only 10 KV blocks, which forces preemption.
IDENTITY_CONFIGS = {
    "defaults": {},
    "budget 32": {"max_num_batched_tokens": 32},
    "budget 64, 10 blocks": {"max_num_batched_tokens": 64, "num_blocks": 10},
}


@dataclass
class IdentityRow:
    name: str
    steps: int
    preemptions: int
    seconds: float
    identical: bool


@dataclass
class IdentityResult:
    reference: list[list[int]]
    reference_seconds: float
    rows: list[IdentityRow]
    engines: dict[str, LLMEngine]
    outputs: dict[str, list[list[int]]]

    @property
    def all_identical(self) -> bool:
        return all(r.identical for r in self.rows)

    def table(self) -> str:
        lines = [f"{'config':<22}{'steps':>6}{'preempt':>9}{'seconds':>9}  identical",
                 f"{'alone (generate)':<22}{'-':>6}{'-':>9}{self.reference_seconds:>9.2f}  (reference)"]
        for r in self.rows:
            lines.append(f"{r.name:<22}{r.steps:>6}{r.preemptions:>9}{r.seconds:>9.2f}  {r.identical}")
        return "\n".join(lines)


def reference_outputs(model: Transformer, prompts: Sequence[Sequence[int]], max_tokens: int,
                      attention_backend: str = "torch") -> list[list[int]]:
    """Each prompt alone through `mini_llm.generate`, greedy, with the engine's attention backend."""
    return [generate(model, p, max_tokens, model.config.eos_token_id, attention_backend) for p in prompts]


def identity_check(model: Transformer, prompts: Sequence[Sequence[int]], max_tokens: int = 24,
                   configs: dict[str, dict] | None = None, **common) -> IdentityResult:
    """Reference outputs, then the engine under each config; `common` settings apply to all."""
    t = time.perf_counter()
    ref = reference_outputs(model, prompts, max_tokens, common.get("attention_backend", "torch"))
    ref_s = time.perf_counter() - t
    rows, engines, outputs = [], {}, {}
    for name, cfg in (configs or IDENTITY_CONFIGS).items():
        with LLMEngine(model, **{**common, **cfg}) as engine:  # closed: its worker processes, if any, stop
            t = time.perf_counter()
            done = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
            seconds = time.perf_counter() - t
        outputs[name] = [r.output_ids for r in done]
        rows.append(IdentityRow(name, engine.stats.steps, engine.stats.preemptions, seconds,
                                outputs[name] == ref))
        engines[name] = engine
    return IdentityResult(ref, ref_s, rows, engines, outputs)


def trace_rows(log: Sequence[StepRecord], first: int = 6) -> list[tuple[int, int, int, int]]:
    """(tokens, requests, prefill tokens, waiting) of the first steps of a step log."""
    return [(r.num_tokens, r.num_requests, r.num_prefill_tokens, r.num_waiting) for r in islice(log, first)]


def format_trace(log: Sequence[StepRecord], first: int = 6) -> str:
    lines = [f"{'step':>4}{'tokens':>8}{'requests':>10}{'prefill':>9}{'waiting':>9}  who got what"]
    for rec in islice(log, first):
        who = " ".join(f"{rid}:{n}{kind[0]}" for rid, n, kind in rec.scheduled)
        lines.append(f"{rec.step:>4}{rec.num_tokens:>8}{rec.num_requests:>10}{rec.num_prefill_tokens:>9}"
                     f"{rec.num_waiting:>9}  {who}")
    return "\n".join(lines)


def run_arrivals(engine: LLMEngine, arrivals: Sequence[tuple[int, Sequence[int], SamplingParams]],
                 max_steps: int = 100_000) -> list:
    """Run requests that arrive at given steps: (step, prompt_ids, params), in any order.

    Returns the finished requests in the order given. A request arriving at step s is added just
    before step s runs, so it can be scheduled in that step.
    """
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    ids: dict[int, str] = {}
    k = step = 0
    while k < len(order) or engine.has_unfinished():
        while k < len(order) and arrivals[order[k]][0] <= step:
            _, prompt, params = arrivals[order[k]]
            ids[order[k]] = engine.add_request(prompt, params)
            k += 1
        if engine.has_unfinished():
            engine.step()
        step += 1
        if step > max_steps:
            raise RuntimeError(f"not finished after {max_steps} steps")
    return [engine.requests[ids[i]] for i in range(len(arrivals))]
