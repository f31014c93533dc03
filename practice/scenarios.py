"""Scripted scenarios for the scheduler exercises: play a Scheduler step by step without a model,
record its decisions, and report the first step where the learner's differ from the reference's.

A scenario lists requests (prompt length, max_tokens, the step they arrive at, priority) and the
scheduler's settings. `play` runs it the way the engine does after each forward pass (a chunk that
reaches a request's last token samples one token; a request stops at max_tokens), with prefix
caching off, so that the trace depends on the scheduling decisions alone. `check_scenario` finds
the first step that differs; practice/hints.py names the kind of mistake in one sentence.

A step compares everything the statements specify: the chunks (request, tokens, kind), the
preempted requests, the queues, the free blocks and each request's own state (status,
num_computed, blocks held, num_preemptions, recompute_until). practice/randomized.py draws many
such scenarios at random, so that a solution right only at the scripted settings fails.
"""

from __future__ import annotations

from nano_engine import BlockPool, Request, RequestStatus, SamplingParams

from .hints import explain, show
from .scenario_types import Arrival, Scenario, Step  # noqa: F401 (Arrival: the cases import it from here)
from .worker import Mismatch


def state(req) -> tuple:
    status = req.status.name if isinstance(req.status, RequestStatus) else repr(req.status)
    return (status, req.num_computed, len(req.block_ids), req.num_preemptions, req.recompute_until)


_TOKENS = [1 + i % 50 for i in range(2100)]  # prompts are slices of it: any tokens do without a model


def make_request(a: Arrival, seq: int) -> Request:
    start = 7 * seq % 50
    prompt = _TOKENS[start:start + a.prompt_len] if a.prompt_len <= 2050 else [1] * a.prompt_len
    return Request(a.rid, prompt, SamplingParams(max_tokens=a.max_tokens), arrival_time=a.time(seq),
                   priority=a.priority, seq=seq)


def play(scheduler_cls, sc: Scenario, max_steps: int = 1000) -> list[Step]:
    s = scheduler_cls(sc.config, BlockPool(sc.num_blocks, enable_prefix_caching=False), sc.block_size)
    last_arrival, steps, added = max(a.step for a in sc.arrivals), [], []
    for t in range(max_steps):
        for seq, a in enumerate(sc.arrivals):
            if a.step == t:
                added.append(make_request(a, seq))
                s.add_request(added[-1])
        if t > last_arrival and not s.has_unfinished():
            break
        step = Step(t, f"running {_queue(s.running)}; waiting {_queue(s.waiting)}; {s.pool.num_free} free blocks",
                    [r.request_id for r in s.running], [r.request_id for r in s.waiting],
                    {r.request_id: r.num_behind for r in [*s.running, *s.waiting]})
        out = s.schedule()
        step.problem = _record(s, out, step)
        step.states = {r.request_id: state(r) for r in added}
        steps.append(step)
        if step.problem:
            break
        for c in out.chunks:  # what the engine does with the forward pass's result
            req = c.request
            req.num_computed = c.start + c.n
            if req.num_computed == req.num_tokens:
                req.output_ids.append(1 + len(req.output_ids) % 50)
                if len(req.output_ids) >= req.sampling_params.max_tokens:
                    s.finish(req, "length")
    return steps


def _queue(q) -> str:
    """Each request as id computed/tokens, e.g. "a 8/9"."""
    return ", ".join(f"{r.request_id} {r.num_computed}/{r.num_tokens}" for r in q) or "-"


def _record(s, out, step: Step) -> str | None:
    """Fill in the step's decisions; describe the first impossible one, if any."""
    if not (hasattr(out, "chunks") and hasattr(out, "preempted")):
        return problem(s, out)
    step.scheduled = [(c.request.request_id, c.n, c.kind) for c in out.chunks]
    step.preempted = [r.request_id for r in out.preempted]
    step.running, step.waiting = [r.request_id for r in s.running], [r.request_id for r in s.waiting]
    step.free = s.pool.num_free
    return problem(s, out)


def problem(s, out) -> str | None:
    """The first decision in this step's output that no scheduler may take, in one sentence."""
    if not (hasattr(out, "chunks") and hasattr(out, "preempted")):
        return f"schedule() returned {type(out).__name__}, not a SchedulerOutput"
    seen, left = set(), s.config.max_num_batched_tokens
    for c in out.chunks:
        req, rid = c.request, repr(c.request.request_id)
        if id(req) in seen:
            return f"{rid} was scheduled twice in one step: one chunk per request per step"
        seen.add(id(req))
        if req not in s.running:
            return (f"{rid} was scheduled but is not in the running queue (admitted requests move to running; "
                    "preempted ones lose their chunk)")
        if req.status is not RequestStatus.RUNNING:
            return (f"{rid} was scheduled but its status is {getattr(req.status, 'name', req.status)}: an admitted "
                    "request's status is RequestStatus.RUNNING")
        if c.n < 1:
            return f"{rid} was scheduled {c.n} tokens: schedule only requests that get at least one token"
        if c.start != req.num_computed:
            return (f"{rid}'s chunk starts at token {c.start} but its num_computed is {req.num_computed}: "
                    "a chunk starts where the KV ends")
        if c.start + c.n > req.num_tokens:
            return (f"{rid} was scheduled {c.n} tokens but is only {req.num_behind} behind: "
                    "n = min(tokens behind, budget left)")
        # (A victim already scheduled gives its tokens back, after the chunk that needed its blocks was sized.)
        if c.n < min(req.num_behind, left) and not out.preempted:
            return (f"{rid} was scheduled {c.n} tokens while it is {req.num_behind} behind and {left} of the "
                    "budget were left: n = min(tokens behind, budget left), where tokens behind = num_tokens - "
                    "num_computed (a preempted request is behind by its prompt and the outputs it had)")
        left -= c.n
        if len(req.block_ids) * s.block_size < c.start + c.n:
            return (f"{rid} is scheduled up to token {c.start + c.n} but its block table holds only "
                    f"{len(req.block_ids) * s.block_size} slots: allocate_slots must make room for "
                    "num_computed + n tokens")
    for r in out.preempted:
        if r in s.running:
            return (f"{r.request_id!r} was preempted and readmitted: a request was admitted in a step that "
                    "preempted, but vLLM admits nobody after a preemption (memory is short)")
        if r.block_ids or r.num_computed:
            return (f"{r.request_id!r} was preempted but still holds {len(r.block_ids)} block(s) and num_computed "
                    f"{r.num_computed}: preempt must free all its blocks and set num_computed to 0")
        if r not in s.waiting:
            return (f"{r.request_id!r} was preempted but is not in the waiting queue: preempt puts it back at "
                    "the FRONT of the waiting queue")
        if r.status is not RequestStatus.WAITING:
            return (f"{r.request_id!r} was preempted but its status is {getattr(r.status, 'name', r.status)}: "
                    "preempt must set req.status = RequestStatus.WAITING")
    for r in s.waiting:
        if r.block_ids:
            return (f"{r.request_id!r} is waiting but holds {len(r.block_ids)} block(s): allocate_slots takes all "
                    "the blocks it needs or none (when too few are free, return False without taking any)")
    return None


def check_scenario(scheduler_cls, reference_cls, sc: Scenario) -> None:
    """Play the scenario with both schedulers; raise Mismatch at the first step that differs."""
    expected = play(reference_cls, sc)
    assert expected and not expected[-1].problem, "the reference failed its own scenario"
    got = play(scheduler_cls, sc, max_steps=len(expected) + 1)
    for e, g in zip(expected, got):
        hint = explain(sc, e, g)
        if hint:
            raise Mismatch(*sc.describe(), *show(sc, e, g), "hint: " + hint)
    if len(got) != len(expected):
        more = len(got) > len(expected)
        raise Mismatch(*sc.describe(), f"the reference finished every request in {len(expected)} steps; "
                       + ("yours still had requests after that" if more else f"your run stopped after {len(got)}"),
                       "hint: " + ("a step that schedules nothing while requests wait never ends" if more
                                   else "a request finishes only when it has max_tokens outputs"))
