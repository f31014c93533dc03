"""Random scenarios for the scheduler exercises: hundreds of small runs, step by step against the reference.

The scripted scenarios (practice/scenarios.py) each test one rule at one setting; a solution can
be right at those settings only (admitting after a preemption when the budget is large, say).
Here every setting the engine accepts is drawn: budgets 1..512, block sizes 1..32, max_num_seqs
1..8, pools from the tightest one that still takes every request to a roomy one, chunked prefill
on and off, arrivals over time, priorities with ties in priority and in arrival_time, aging.
Each scenario is played with both schedulers and compared at every step (`check_scenario`); the
scenarios are drawn from a fixed seed, so a failure can be replayed, and tried smallest first, so
that the one reported is as short as can be. Like vLLM's own randomized scheduler tests
(`tests/v1/core/test_scheduler.py`), but against a reference rather than invariants alone.
"""

from __future__ import annotations

import math
import random

from nano_engine import BlockPool

from .scenarios import Arrival, Scenario, check_scenario, make_request

MAX_PROMPT = 600  # tokens; with budgets down to 1, prompts stay within ~8 chunks so a run stays short


def random_scenario(rng: random.Random, reference_cls, *, chunked: bool | None = None, tight: bool | None = None,
                    priority: bool = False, aging: bool = False) -> Scenario:
    """One scenario that the reference accepts (None: chunking on or off, tight pool or not, at random)."""
    chunked = rng.random() < 0.6 if chunked is None else chunked
    tight = rng.random() < 0.5 if tight is None else tight
    budget = rng.choice([rng.randint(1, 16), rng.randint(1, 64), rng.randint(1, 512)])
    if not chunked:
        budget = max(budget, 2)  # a request needs at least its 1-token prompt and one more token
    block_size = rng.randint(1, 32)
    arrivals = []
    for i in range(rng.randint(1, 8)):
        max_tokens = rng.randint(1, 8) if chunked else rng.randint(1, min(8, budget - 1))
        # Without chunking, prompt + max_tokens <= budget: a recomputed request must fit one step.
        longest = min(MAX_PROMPT, 8 * budget) if chunked else budget - max_tokens
        arrivals.append(Arrival(f"r{i}", rng.randint(1, longest), max_tokens, step=rng.randint(0, 12),
                                priority=rng.randint(0, 3) if priority else 0,
                                arrival_time=rng.choice([None, None, float(rng.randint(0, 3))]) if priority else None))
    arrivals.sort(key=lambda a: a.step)  # arrival order = the order they are added
    settings = dict(max_num_batched_tokens=budget, max_num_seqs=rng.randint(1, 8), enable_chunked_prefill=chunked)
    if priority:
        settings.update(policy="priority", priority_aging=rng.choice([0.25, 0.5, 1.0]) if aging else 0.0)
    sc = Scenario(arrivals, num_blocks=1, block_size=block_size, settings=settings)
    # The tightest legal pool: the largest request's KV, in blocks, as the engine counts it.
    need = max(math.ceil(make_request(a, i).max_kv_tokens / block_size) for i, a in enumerate(arrivals))
    sc.num_blocks = need if tight else need + rng.randint(0, 3 * need)
    _accepted(reference_cls, sc)
    return sc


def _accepted(reference_cls, sc: Scenario) -> None:
    """The reference refuses a request that could never run: a scenario must not contain one."""
    s = reference_cls(sc.config, BlockPool(sc.num_blocks, enable_prefix_caching=False), sc.block_size)
    for seq, a in enumerate(sc.arrivals):
        s.add_request(make_request(a, seq))  # raises ValueError, naming the request, if it could not


def _size(sc: Scenario) -> tuple:
    return (len(sc.arrivals), sum(a.prompt_len + a.max_tokens for a in sc.arrivals))


def check_random(scheduler_cls, reference_cls, seed: int, count: int, **kinds) -> None:
    """Draw `count` scenarios from `seed` and compare each step; raise Mismatch for the smallest that differs."""
    rng = random.Random(seed)
    scenarios = sorted((random_scenario(rng, reference_cls, **kinds) for _ in range(count)), key=_size)
    for i, sc in enumerate(scenarios):
        sc.label = f"random scenario {i + 1} of {count} (seed {seed}, the smallest that differs)"
        check_scenario(scheduler_cls, reference_cls, sc)
