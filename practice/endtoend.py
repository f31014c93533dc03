"""End-to-end cases: the real engine, with the learner's scheduler, on a tiny float64 model.

However requests are batched, chunked or preempted, each one's tokens must equal what
`nano_engine.generate` gives for it alone (greedy, so exactly). The reference scheduler runs the
same workload first, to bound the number of steps and to say what the run should have looked like.
"""

from __future__ import annotations

import random

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.tiny import tiny_model

from .scenarios import problem
from .worker import Mismatch


def recording(scheduler_cls):
    """The scheduler, keeping its last output in `.last`: what a step did, whatever the engine logs."""

    class Recording(scheduler_cls):
        last = None

        def schedule(self):
            self.last = super().schedule()
            return self.last

    return Recording


def _checked(scheduler_cls):
    """The learner's scheduler, with every step's output checked before the model runs it."""

    class Checked(recording(scheduler_cls)):
        steps = 0

        def schedule(self):
            out = super().schedule()
            trouble = problem(self, out)
            if trouble:
                raise Mismatch(f"step {self.steps} of the engine run: an impossible schedule", "hint: " + trouble)
            self.steps += 1
            return out

    return Checked


def _run(scheduler_cls, model, prompts, workload, settings: dict, max_steps: int):
    """Run the workload; returns the engine and the requests (held here: the engine may release them)."""
    engine = LLMEngine(model, scheduler_cls=_checked(scheduler_cls), **settings)
    reqs = []
    for i, (p, (_, m, prio)) in enumerate(zip(prompts, workload)):
        rid = engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), request_id=f"r{i}", priority=prio)
        reqs.append(engine.requests[rid])
    budget, s = engine.config.scheduler_config.max_num_batched_tokens, engine.scheduler
    while engine.has_unfinished():
        step = engine.stats.steps
        if step >= max_steps:
            raise Mismatch(f"requests were still unfinished after {max_steps} steps",
                           "hint: every step must move some request forward while requests wait")
        engine.step()
        tokens = sum(c.n for c in s.last.chunks)
        if not s.last.chunks:
            raise Mismatch(f"step {step} scheduled nothing while {len(s.waiting)} requests waited "
                           f"and {len(s.running)} ran: the engine would spin forever",
                           "hint: when nothing runs the whole pool is free, so the head of the waiting queue "
                           "can always be admitted")
        if tokens > budget:
            raise Mismatch(f"step {step} scheduled {tokens} tokens, above max_num_batched_tokens={budget}",
                           "hint: total tokens exceeded max_num_batched_tokens")
    return engine, reqs


def check_end_to_end(scheduler_cls, reference_cls, settings: dict, workload: list[tuple[int, int, int]],
                     seed: int = 0, expect_preemption: bool = False) -> None:
    """workload: (prompt length, max_tokens, priority) per request, all added before the first step."""
    model = tiny_model(seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(n)] for n, _, _ in workload]
    ref, _ = _run(reference_cls, model, prompts, workload, settings, max_steps=10_000)
    assert ref.stats.preemptions > 0 or not expect_preemption, "this case should force a preemption"
    engine, reqs = _run(scheduler_cls, model, prompts, workload, settings, max_steps=3 * ref.stats.steps + 20)
    setting = ", ".join(f"{k}={v}" for k, v in settings.items())
    for req, p, (_, m, _) in zip(reqs, prompts, workload):
        rid, want, got = req.request_id, generate(model, p, m), req.output_ids
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise Mismatch(
                f"engine({setting}), {len(workload)} requests: request {rid} (prompt {len(p)} tokens) differs "
                f"from generating it alone at output token {at}",
                f"  expected  {want}", f"  got       {got}",
                f"the reference scheduler took {ref.stats.steps} steps with {ref.stats.preemptions} preemptions; "
                f"yours {engine.stats.steps} steps with {engine.stats.preemptions}",
                "hint: outputs must not depend on batching: each chunk starts at num_computed, its block table "
                "covers num_computed + n tokens, and a preempted request recomputes from token 0")
