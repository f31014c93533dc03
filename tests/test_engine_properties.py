"""Property tests: whatever the workload and settings, every request gets the tokens it would get
alone, and the scheduler keeps its invariants (budget, max_num_seqs, no admission in a step that
preempted, chunk starts, block references, every filled block named in the prefix cache).

The strategies are steered towards the states worth checking: four or five overlapping requests
in a pool of a quarter of the blocks they need, never less than the largest one (preemption),
mostly priority and conservative policies, shared prefixes and arrivals over time (prefix-cache
hits), budgets of a quarter to a half of the longest prompt (chunked prefill), aborts, seeded
sampled requests, priorities with aging. Hypothesis starts from the simplest example, so each
draw's simplest value is the busy one (longest output, most seats, a prefix, caching on).
`test_the_workloads_reach_every_path` counts, over a fixed seeded batch, how often each path is
taken, so that a change to the strategies cannot quietly stop testing one. Run longer with
HYPOTHESIS_PROFILE=long (tests/conftest.py).
"""

import dataclasses
import math
import os
from collections import Counter
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.paged import block_hashes
from nano_engine.tiny import perturbed, tiny_model

MODEL = tiny_model(seed=1)
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PATHS = ("preemption", "preemption under priority or conservative", "prefix-cache hit", "chunked prefill",
         "arrival after step 0", "abort", "sampled request")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's matrices are too small for threads: on 2 cores one thread runs twice as fast."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@lru_cache(maxsize=None)
def greedy_reference(prompt: tuple, max_tokens: int) -> list[int]:
    return generate(MODEL, prompt, max_tokens, MODEL.config.eos_token_id)


@lru_cache(maxsize=None)
def alone(prompt: tuple, params: SamplingParams) -> list[int]:
    """A sampled request's tokens when it runs alone: its own seeded generator decides them."""
    return LLMEngine(MODEL, num_blocks=64).generate([list(prompt)], params)[0].output_ids


@st.composite
def sampling_params(draw):
    max_tokens = 10 - draw(st.integers(0, 7))  # 3..10; the simplest example decodes longest
    if draw(st.integers(0, 9)) >= 4:  # 40% sampled (and the simplest example is one)
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
                          top_k=draw(st.sampled_from([0, 5])), top_p=draw(st.sampled_from([1.0, 0.8])),
                          seed=draw(st.integers(0, 2**16)))


@st.composite
def workloads(draw):
    """Requests as (prompt, params, priority, arrival step, abort step or None), mostly overlapping."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    prefix = draw(st.lists(st.integers(1, 63), min_size=block_size, max_size=16))  # a shared system prompt
    reqs = []
    for i in range(draw(st.integers(4, 5))):
        own = draw(st.lists(st.integers(1, 63), min_size=2, max_size=12))
        prompt = (prefix if draw(st.integers(0, 4)) < 4 else []) + own
        arrival = 0 if i < 3 else draw(st.sampled_from([1, 3, 0, 5]))
        abort = arrival + draw(st.integers(1, 6)) if draw(st.integers(0, 2)) == 0 else None
        reqs.append((tuple(prompt), draw(sampling_params()), draw(st.integers(-2, 2)), arrival, abort))
    return block_size, reqs


@st.composite
def engine_settings(draw, block_size, reqs):
    blocks = [math.ceil((len(p) + sp.max_tokens - 1) / block_size) for p, sp, *_ in reqs]
    longest = max(len(p) for p, *_ in reqs)
    policy = draw(st.sampled_from(["priority", "conservative", "fcfs", "priority", "conservative", "static",
                                    "priority", "conservative"]))
    chunked = policy != "static" and draw(st.integers(0, 9)) < 9
    if chunked:  # shorter than the longest prompt, which is then cut into chunks
        budget = max(1, longest // 2 - draw(st.integers(0, longest // 4)))
    else:  # a whole prompt (or a recompute) must fit one step
        budget = max(len(p) + sp.max_tokens for p, sp, *_ in reqs) + draw(st.integers(0, 16))
    cfg = dict(
        block_size=block_size,
        num_blocks=max(max(blocks), sum(blocks) // 4 + draw(st.integers(0, 2))),  # short of what they need
        max_num_batched_tokens=budget,
        max_num_seqs=8 - draw(st.integers(0, 5)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.integers(0, 4)) < 4,
        policy=policy,
    )
    if policy == "priority":
        cfg["priority_aging"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    if policy == "conservative":  # a low ratio admits more, so that retraction happens
        cfg.update(init_new_token_ratio=draw(st.sampled_from([0.05, 0.1])), min_new_token_ratio=0.05)
    return cfg


def check_blocks(engine):
    pool = engine.block_pool
    pool.check()
    held = Counter(b for r in engine.scheduler.running for b in r.block_ids)
    assert all(pool.ref_count[b] == held.get(b, 0) for b in range(pool.num_blocks))
    assert not any(r.block_ids for r in engine.scheduler.waiting)


def run_scenario(block_size, reqs, cfg) -> set[str]:
    """Play the workload through the engine, checking every step; returns the paths it took."""
    engine = LLMEngine(MODEL, **cfg)
    scheduler, paths, outs = engine.scheduler, set(), []
    schedule = scheduler.schedule

    def checked_schedule():
        running_before = list(scheduler.running)
        out = schedule()
        outs.append(out)
        assert out.num_tokens <= cfg["max_num_batched_tokens"]
        assert len(out.chunks) <= cfg["max_num_seqs"] and len(scheduler.running) <= cfg["max_num_seqs"]
        for c in out.chunks:
            assert c.n >= 1 and c.start == c.request.num_computed and c.request in scheduler.running
            if c.request not in running_before and c.start > 0:
                paths.add("prefix-cache hit")
            if c.kind == "prefill" and c.start + c.n < c.request.num_prompt_tokens:
                paths.add("chunked prefill")
        if out.num_tokens < cfg["max_num_batched_tokens"]:  # budget left: no running request was passed over
            got = {id(c.request) for c in out.chunks}
            assert all(id(r) in got for r in running_before if r not in out.preempted), "a request was skipped"
        if out.preempted:
            paths.add("preemption")
            if cfg["policy"] in ("priority", "conservative"):
                paths.add("preemption under priority or conservative")
            stayed = [r for r in running_before if r not in out.preempted]
            assert all(c.request in stayed for c in out.chunks), "admitted in a step that preempted"
            assert all(r.block_ids == [] and r.num_computed == 0 for r in out.preempted)
        return out

    forward = engine.runner.forward

    def checked_forward(batch):  # the model computes exactly the scheduled tokens, from their starts
        assert batch.num_tokens == outs[-1].num_tokens
        assert batch.num_cached == [c.start for c in outs[-1].chunks]
        return forward(batch)

    scheduler.schedule, engine.runner.forward = checked_schedule, checked_forward
    ids: dict[int, str] = {}
    step = 0
    while len(ids) < len(reqs) or engine.has_unfinished():
        if not engine.has_unfinished():  # idle: the clock jumps to the next arrival
            step = max(step, min(arrival for i, (_, _, _, arrival, _) in enumerate(reqs) if i not in ids))
        for i, (prompt, sp, priority, arrival, abort) in enumerate(reqs):
            if i not in ids and arrival <= step:
                ids[i] = engine.add_request(list(prompt), sp, priority=priority)
                paths |= {"arrival after step 0"} if step > 0 else set()
            if i in ids and abort is not None and abort <= step and not engine.requests[ids[i]].is_finished:
                engine.abort(ids[i])
                paths.add("abort")
        if not engine.has_unfinished():
            continue
        num_outs = len(outs)
        engine.step()
        step += 1
        out = outs[-1]
        assert len(outs) == num_outs + 1 and out.chunks, "a step with unfinished requests must schedule something"
        if cfg["enable_prefix_caching"]:  # every block this step filled is named in the prefix cache
            for c in out.chunks:  # (with drafts: the blocks of the tokens kept, not of the refused drafts')
                filled = min(c.start + c.n, c.request.num_computed, c.request.num_tokens)
                hashes = block_hashes(c.request.all_token_ids, block_size, filled // block_size)
                assert all(h in engine.block_pool.cached for h in hashes[c.start // block_size:]), \
                    "a block filled in this step was never named in the prefix cache"
        check_blocks(engine)
        assert step < 5000
    for i, (prompt, sp, _, _, abort) in enumerate(reqs):
        req = engine.requests[ids[i]]
        want = greedy_reference(prompt, sp.max_tokens) if sp.greedy else alone(prompt, sp)
        if req.finish_reason == "abort":
            assert req.output_ids == want[:len(req.output_ids)], (i, cfg)
        else:
            assert req.output_ids == want, (i, cfg)
        if not sp.greedy and req.output_ids:
            paths.add("sampled request")
    assert engine.block_pool.num_free == cfg["num_blocks"]
    assert not getattr(engine.proposer, "caches", None), "a draft model kept a finished request's cache"
    if engine.stats.spec_num_accepted_tokens:
        paths.add("drafts accepted")
    if engine.stats.spec_num_accepted_tokens < engine.stats.spec_num_draft_tokens:
        paths.add("drafts refused")
    return paths


@st.composite
def scenarios(draw):
    block_size, reqs = draw(workloads())
    return block_size, reqs, draw(engine_settings(block_size, reqs))


@settings(max_examples=1000 if LONG else 20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_engine_equals_single_request_runs(scenario):
    for path in run_scenario(*scenario):
        event(path)


DRAFT = perturbed(MODEL, 0.1, seed=7)


@st.composite
def speculative_scenarios(draw):
    block_size, reqs, cfg = draw(scenarios())
    k = draw(st.integers(1, 5))
    if draw(st.booleans()):
        spec = {"num_speculative_tokens": k, "prompt_lookup_max": draw(st.integers(1, 3))}
        spec["prompt_lookup_min"] = draw(st.integers(1, spec["prompt_lookup_max"]))
    else:  # a draft model, drafting greedily (vLLM's default): q one-hot
        spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k}
    return block_size, reqs, {**cfg, "speculative_config": spec}


@settings(max_examples=200 if LONG else 24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(speculative_scenarios())
def test_speculative_decoding_changes_no_token_and_returns_every_block(scenario):
    """With n-gram drafts (any k and n-gram lengths) or a draft model's, under every setting above:
    each request gets the tokens it gets alone without drafts (greedy: generate's; seeded: the same
    draws), the scheduler's invariants hold with drafts in the budget, and every block comes back
    (refused drafts' included)."""
    event(f"proposer: {scenario[2]['speculative_config'].get('method', 'ngram')}")
    for path in run_scenario(*scenario):
        event(path)


def test_the_workloads_reach_every_path():
    """Over a fixed seeded batch, each path is taken in at least a third of the examples.

    The batch is what Hypothesis generates for this strategy when derandomized: the same examples
    every run (for a given Hypothesis version), each one checked like the random ones above.
    """
    counts, n = Counter(), [0]

    @settings(max_examples=40, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def count(scenario):
        counts.update(run_scenario(*scenario))
        n[0] += 1

    count()
    print(f"paths taken in {n[0]} examples: " + ", ".join(f"{p} {counts[p]}" for p in PATHS))
    assert all(counts[p] >= n[0] / 3 for p in PATHS), counts


MODEL_BF16 = tiny_model(seed=1, dtype=torch.bfloat16)


@settings(max_examples=200 if LONG else 30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_c_attention_backend_gives_every_request_what_it_gets_alone(scenario):
    """attention_backend="c" (kernels/paged_attention.py) computes a row by the same operations in any
    company, so under any scheduling (preemption, chunks, prefix hits, every policy) a greedy request
    gets generate()'s tokens with the same backend, and a seeded one the tokens it gets alone, with
    the logprobs of each token to the bit."""
    _, reqs, cfg = scenario
    prompts = [list(p) for p, *_ in reqs]
    params = [dataclasses.replace(sp, logprobs=0) for _, sp, *_ in reqs]
    engine = LLMEngine(MODEL_BF16, attention_backend="c", **cfg)
    done = engine.generate(prompts, params)
    event(f"preempted: {engine.stats.preemptions > 0}")
    for prompt, sp, r in zip(prompts, params, done):
        one = LLMEngine(MODEL_BF16, attention_backend="c", num_blocks=64).generate([prompt], sp)[0]
        assert (r.output_ids, r.logprobs) == (one.output_ids, one.logprobs)
        if sp.greedy:
            assert r.output_ids == generate(MODEL_BF16, prompt, sp.max_tokens, MODEL_BF16.config.eos_token_id, "c")
