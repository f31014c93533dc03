"""Hints for the scheduler exercises: name the mistake behind a step that differs, in one sentence.

`explain` compares one step of the reference's play with the learner's (practice/scenarios.py)
and checks the differences from the most telling to the least: the budget, max_num_seqs,
admission after a preemption, an impossible decision, the victim, each request's share, the queue
order, the pool's free blocks, each request's own state. Under the priority policy the report
lists every request's key at the step that differs, the hints speak in keys, and the waiting
queue's order is not compared (the policy picks from it by key, so a solution that keeps it
sorted decides the same).
"""

from __future__ import annotations

from .scenario_types import Scenario, Step

STATE_FIELDS = ("status", "num_computed", "blocks held", "num_preemptions", "recompute_until")


def _fmt(sched: list) -> str:
    return ", ".join(f"{rid} {n} {kind}" for rid, n, kind in sched) or "nothing"


def _prio(sc: Scenario) -> bool:
    return sc.config.policy == "priority"


def _waiting(sc: Scenario, step: Step) -> list[str]:
    """The waiting queue as compared: in order under fcfs, as a set (in key order) under priorities."""
    return sorted(step.waiting, key=lambda rid: sc.key(rid, step.index)) if _prio(sc) else step.waiting


def show(sc: Scenario, e: Step, g: Step) -> list[str]:
    rows = [f"step {e.index}, before it: {e.before}",
            f"  scheduled  expected  {_fmt(e.scheduled)}", f"             got       {_fmt(g.scheduled)}",
            f"  preempted  expected  {', '.join(e.preempted) or '-'}",
            f"             got       {', '.join(g.preempted) or '-'}"]
    if _prio(sc):
        keys = sorted(e.running_before + e.waiting_before, key=lambda rid: sc.key(rid, e.index))
        rows += [f"  keys at step {e.index} (priority - {sc.config.priority_aging:g} x steps waited, arrival_time, "
                 "seq), smallest first:", "    " + ", ".join(f"{rid} {_key(sc, rid, e.index)}" for rid in keys)]
    if g.problem:
        return rows
    for label, a, b in (("running", e.running, g.running), ("waiting", _waiting(sc, e), _waiting(sc, g))):
        if a != b:
            rows += [f"  {label:9}  expected  {', '.join(a) or '-'}", f"             got       {', '.join(b) or '-'}"]
    if e.free != g.free:
        rows += [f"  free KV blocks after the step: expected {e.free}, got {g.free}"]
    rid, i = _first_state_difference(e, g)
    if rid is not None:
        rows += [f"  {rid}'s {STATE_FIELDS[i]} after the step: expected {e.states[rid][i]}, "
                 f"got {g.states.get(rid, ('-',) * 5)[i]}"]
    return rows


def _key(sc: Scenario, rid: str, step: int) -> str:
    effective, time, seq = sc.key(rid, step)
    return f"({effective:g}, {time:g}, {seq})"


def _first_state_difference(e: Step, g: Step) -> tuple[str | None, int]:
    for rid, want in e.states.items():
        got = g.states.get(rid)
        if got != want:
            return rid, next(i for i in range(len(want)) if got is None or got[i] != want[i])
    return None, 0


_STATE_HINTS = {
    "status": "admission sets req.status = RequestStatus.RUNNING, preempt sets it back to WAITING",
    "num_computed": "preempt sets num_computed to 0; an admitted request starts at 0 (prefix caching is off)",
    "blocks held": ("allocate_slots grows the block table to ceil((num_computed + n) / block_size) blocks, and "
                    "preempt frees them all"),
    "num_preemptions": "preempt must count the preemption: req.num_preemptions += 1",
    "recompute_until": ("preempt must remember how far the KV went before dropping it: req.recompute_until = "
                        "max(req.recompute_until, req.num_computed), before num_computed = 0"),
}


def explain(sc: Scenario, e: Step, g: Step) -> str | None:
    """One sentence naming the mistake in this step, or None if the step is as expected."""
    cfg, prio = sc.config, _prio(sc)
    tokens = sum(n for _, n, _ in g.scheduled)
    if tokens > cfg.max_num_batched_tokens:
        return (f"total tokens exceeded max_num_batched_tokens ({tokens} > {cfg.max_num_batched_tokens}): "
                "every request's share, running ones included, comes out of one budget")
    if len(g.running) > cfg.max_num_seqs:
        return (f"more than max_num_seqs requests running ({len(g.running)} > {cfg.max_num_seqs}): "
                "stop admitting when the running queue is full")
    admitted = [rid for rid, _, _ in g.scheduled if rid in g.waiting_before]
    if g.preempted and admitted:
        return (f"a request was admitted in a step that preempted ({', '.join(admitted)}): vLLM admits nobody "
                "after a preemption, since memory is short and admitting more would thrash")
    if g.problem:
        return g.problem
    if e.preempted != g.preempted:
        return _explain_victims(sc, e, g, prio)
    if e.scheduled != g.scheduled:
        return _explain_shares(sc, e, g, prio)
    for rid in [] if prio else e.preempted:
        if e.waiting.index(rid) != g.waiting.index(rid):
            return f"a preempted request goes back to the FRONT of the waiting queue, so {rid!r} is readmitted first"
    if (e.running, _waiting(sc, e)) != (g.running, _waiting(sc, g)):
        if prio:
            return ("the queues differ: running keeps admission order (a victim leaves it, an admitted request "
                    "joins its end), and waiting holds every request that is not running")
        return ("the queues are out of order: running keeps admission order, waiting keeps its order with "
                "preempted requests at the front")
    if e.free != g.free:
        return ("the pool's free block count differs: allocate_slots should take exactly the blocks that "
                "num_computed + n tokens need (ceil division by block_size), and preempt must free all the "
                "victim's blocks")
    rid, i = _first_state_difference(e, g)
    if rid is not None:
        field = STATE_FIELDS[i]
        return f"request {rid!r}: its {field} should be {e.states[rid][i]}: " + _STATE_HINTS[field]
    return None


def _explain_victims(sc: Scenario, e: Step, g: Step, prio: bool) -> str:
    if not e.preempted:
        return ("nobody had to be preempted here: a request needs a new block only when num_computed + n "
                "passes a block boundary (ceil(tokens / block_size) blocks)")
    if not g.preempted:
        return ("blocks ran out here: when allocate_slots fails, preempt the victim, free its blocks and "
                "try again, until the blocks can be had or the victim is the request itself")
    if g.preempted[0] != e.preempted[0]:
        victim, wrong = e.preempted[0], g.preempted[0]
        if prio:
            return (f"the victim should be the running request with the largest key (priority, arrival_time, "
                    f"seq): {victim!r} ({_key_text(sc, victim, e.index)}), not {wrong!r} "
                    f"({_key_text(sc, wrong, e.index)})" + _tie(sc, e.index, victim, wrong, "preempted first"))
        where = "its head" if wrong == e.running_before[0] else repr(wrong)
        return (f"the victim should be the tail of the running queue (the most recently admitted request), "
                f"here {victim!r}, not {where}")
    if len(g.preempted) < len(e.preempted):
        return ("one preemption was not enough: keep preempting until the blocks can be had, and stop the "
                "running pass when the victim is the request being scheduled")
    return ("too many preemptions: stop as soon as the blocks can be had, and stop the running pass when "
            "the victim is the request being scheduled")


def _explain_shares(sc: Scenario, e: Step, g: Step, prio: bool) -> str:
    cfg = sc.config
    exp, got = {r: (n, k) for r, n, k in e.scheduled}, {r: (n, k) for r, n, k in g.scheduled}
    if prio and _admitted(e, e) != _admitted(e, g):  # the policy picked another request: speak in keys
        return _explain_admissions(sc, e, g)
    if sorted(e.scheduled) == sorted(g.scheduled):
        return "list the chunks in scheduling order: running requests first, in queue order, then the admitted ones"
    if {r: n for r, (n, _) in exp.items()} == {r: n for r, (n, _) in got.items()}:
        return ("a chunk's kind is wrong: use req.chunk_kind(start), which needs preempt() to set recompute_until "
                "(a 1-token prompt chunk is a prefill, lost KV being redone is a recompute)")
    for rid, (n, _) in exp.items():
        behind, waiting = e.behind[rid], rid in e.waiting_before
        if rid in got and got[rid][0] != n:
            if n < behind and got[rid][0] > n:
                return (f"a prompt longer than the budget left should be chunked: {rid!r} gets {n} of its "
                        f"{behind} tokens now, n = min(tokens behind, budget left)")
            return (f"{rid!r} should get {n} tokens, not {got[rid][0]}: each request gets "
                    "min(tokens behind, budget left)")
        if rid not in got and not waiting:
            return (f"running requests come first: {rid!r} was running and should get "
                    f"min(tokens behind, budget left) = {n} tokens")
        if rid not in got and n < behind and cfg.enable_chunked_prefill:
            return (f"a prompt longer than the budget left should be chunked: {rid!r} should be admitted "
                    f"with the {n} tokens left in the budget, the rest follows in later steps")
        if rid not in got:
            other = next((r for r in got if r in e.waiting_before and r not in exp), None)
            return _admission_order(sc, e, rid, other, prio)
    extra = next(r for r in got if r not in exp)
    if extra in e.waiting_before:
        if not cfg.enable_chunked_prefill and got[extra][0] < e.behind[extra]:
            return (f"with enable_chunked_prefill=False a prompt is never cut: {extra!r} must wait until "
                    "its whole prompt fits the budget left")
        if not cfg.enable_chunked_prefill:
            return (f"with enable_chunked_prefill=False a prompt that does not fit the budget waits, and "
                    f"first come first served, everyone behind it waits too: {extra!r} should not be admitted")
        if prio:
            blocked = next((r for r in e.waiting if sc.key(r, e.index) < sc.key(extra, e.index)), None)
            if blocked:
                return _admission_order(sc, e, blocked, extra, prio)
        return (f"{extra!r} should not be admitted in this step: admission stops at the first waiting request "
                "whose blocks cannot be had, or when the budget or max_num_seqs is used up")
    return f"{extra!r} should get nothing in this step: the budget was used up before its turn"


def _admitted(e: Step, step: Step) -> list[str]:
    return [rid for rid, _, _ in step.scheduled if rid in e.waiting_before]


def _explain_admissions(sc: Scenario, e: Step, g: Step) -> str:
    want, got = _admitted(e, e), _admitted(e, g)
    k = next(i for i in range(max(len(want), len(got))) if want[i:i + 1] != got[i:i + 1])
    if k < len(want) and k < len(got):
        return _admission_order(sc, e, want[k], got[k], True)
    if k < len(want):
        return (f"{want[k]!r}, the waiting request with the smallest key ({_key_text(sc, want[k], e.index)}), "
                "should have been admitted here: budget, blocks and a running slot were left for it")
    blocked = min(e.waiting, key=lambda rid: sc.key(rid, e.index))
    return (f"{got[k]!r} should not be admitted in this step: admission stops at the waiting request with the "
            f"smallest key, {blocked!r} ({_key_text(sc, blocked, e.index)}), when it cannot be admitted, even if "
            "a request behind it would fit")


def _tie(sc: Scenario, step: int, a: str, b: str, outcome: str) -> str:
    (pa, ta, _), (pb, tb, _) = sc.key(a, step), sc.key(b, step)
    if pa != pb:
        return ""
    if ta != tb:
        which = "later" if "preempted" in outcome else "earlier"
        return f"; among equal priorities the {which} arrival_time is {outcome}"
    return (f"; with equal priority and equal arrival_time, seq (the order they were added) decides: the "
            f"{'larger' if 'preempted' in outcome else 'smaller'} seq is {outcome}")


def _key_text(sc: Scenario, rid: str, step: int) -> str:
    (effective, time, seq), (_, a) = sc.key(rid, step), sc.arrival(rid)
    aging = sc.config.priority_aging
    if not aging:
        return f"priority {a.priority}, arrival_time {time:g}, seq {seq}"
    return (f"priority {a.priority} - {aging:g} x {step - a.step} steps waited = {effective:g}, "
            f"arrival_time {time:g}, seq {seq}")


def _admission_order(sc: Scenario, e: Step, rid: str, other: str | None, prio: bool) -> str:
    if prio and other:
        aging = sc.config.priority_aging
        return (f"waiting requests are served smallest key first, key = (priority - priority_aging x steps "
                f"waited, arrival_time, seq): {rid!r} ({_key_text(sc, rid, e.index)}) comes before {other!r} "
                f"({_key_text(sc, other, e.index)})" + _tie(sc, e.index, rid, other, "served first")
                + (f"; with priority_aging={aging:g} every step waited lowers the priority value by {aging:g}"
                   if aging else ""))
    return (f"{rid!r} should have been admitted: waiting requests are admitted in order while budget is left, "
            "their blocks can be had and fewer than max_num_seqs run")
