"""Property tests: whatever the prompts and settings, the engine gives single-request tokens and
keeps its invariants (budget, max_num_seqs, no admission after a preemption, block references)."""

import math
from collections import Counter
from functools import lru_cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.scheduler import POLICIES
from nano_engine.tiny import tiny_model

MODEL = tiny_model(seed=1)


@lru_cache(maxsize=None)
def reference(prompt: tuple, max_tokens: int) -> list[int]:
    return generate(MODEL, prompt, max_tokens, MODEL.config.eos_token_id)


@st.composite
def workloads(draw):
    prefix = draw(st.lists(st.integers(1, 63), min_size=0, max_size=20))  # shared system prompt
    reqs = []
    for _ in range(draw(st.integers(1, 7))):
        own = draw(st.lists(st.integers(1, 63), min_size=1, max_size=30))
        prompt = (prefix if draw(st.booleans()) else []) + own
        reqs.append((tuple(prompt), draw(st.integers(1, 12)), draw(st.integers(-2, 2))))
    return reqs


@st.composite
def engine_settings(draw, reqs):
    block_size = draw(st.integers(1, 32))
    biggest = max(math.ceil((len(p) + m - 1) / block_size) for p, m, _ in reqs)
    policy = draw(st.sampled_from(POLICIES))
    chunked = policy != "static" and draw(st.booleans())
    budget = draw(st.integers(1, 512))
    if not chunked:  # without chunking a whole prompt (or a recompute) must fit one step
        budget = max(budget, max(len(p) + m for p, m, _ in reqs))
    return dict(
        block_size=block_size,
        num_blocks=biggest + draw(st.integers(0, 3 * biggest)),  # barely enough .. ample
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        policy=policy,
        priority_aging=draw(st.sampled_from([0.0, 0.5])),
    )


def check_blocks(engine):
    pool = engine.block_pool
    pool.check()
    held = Counter(b for r in engine.scheduler.running for b in r.block_ids)
    assert all(pool.ref_count[b] == held.get(b, 0) for b in range(pool.num_blocks))
    assert not any(r.block_ids for r in engine.scheduler.waiting)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_engine_equals_single_request_generate(data):
    reqs = data.draw(workloads())
    cfg = data.draw(engine_settings(reqs))
    engine = LLMEngine(MODEL, **cfg)
    ids = [engine.add_request(list(p), SamplingParams(max_tokens=m), priority=prio) for p, m, prio in reqs]
    while engine.has_unfinished():
        running_before = {r.request_id for r in engine.scheduler.running}
        engine.step()
        rec = engine.step_log[-1]
        assert rec.scheduled, "a step with unfinished requests must schedule something"
        assert rec.num_tokens <= cfg["max_num_batched_tokens"]
        assert rec.num_requests <= cfg["max_num_seqs"]
        if rec.preempted:
            assert {rid for rid, _, _ in rec.scheduled} <= running_before, "admitted after a preemption"
        check_blocks(engine)
        assert len(engine.step_log) < 5000
    for rid, (p, m, _) in zip(ids, reqs):
        assert engine.requests[rid].output_ids == reference(p, m), (rid, cfg)
    assert engine.block_pool.num_free == cfg["num_blocks"]
