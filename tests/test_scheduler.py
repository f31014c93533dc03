"""Scripted scheduling scenarios: who gets how many tokens, whom a preemption hits, when admission stops.

Each scenario is built so that the decision it checks could go the other way: a step that preempts
has a request that could be admitted, a waiting queue holds several requests (front and back
differ), priority order differs from admission order, a victim sits earlier in the running queue
than the request that needs the blocks and was already scheduled in that step.
"""

import itertools
import random

import pytest

from nano_engine import (BlockPool, ConservativeScheduler, LLMEngine, PriorityScheduler, Request, RequestStatus,
                         SamplingParams, Scheduler, SchedulerConfig, StaticScheduler, scheduler_class)

_arrivals = itertools.count()  # distinct prompts and a strictly growing arrival time across a test


def make(policy="fcfs", num_blocks=64, block_size=4, prefix_caching=True, **kw):
    return scheduler_class(policy)(SchedulerConfig(policy=policy, **kw), BlockPool(num_blocks, prefix_caching), block_size)


def add(s, rid, n_prompt, max_tokens=8, priority=0, t=None):
    k = next(_arrivals)
    req = Request(rid, list(range(1000 * k + 1, 1000 * k + 1 + n_prompt)), SamplingParams(max_tokens=max_tokens),
                  priority=priority, arrival_time=float(k) if t is None else t, seq=k)
    s.add_request(req)
    return req


def advance(out, token=7):
    """What the engine does after the forward pass (without the model)."""
    for c in out.chunks:
        c.request.num_computed = c.start + c.n
        if c.request.num_computed == c.request.num_tokens:
            c.request.output_ids.append(token)


def plan(out):
    return [(c.request.request_id, c.n, c.kind) for c in out.chunks]


def preempted(out):
    return [r.request_id for r in out.preempted]


def ids(queue):
    return [r.request_id for r in queue]


def test_chunked_prefill_rides_along_with_decodes():
    s = make(max_num_batched_tokens=10)
    add(s, "a", 6), add(s, "b", 7), add(s, "c", 3)
    out = s.schedule()
    assert plan(out) == [("a", 6, "prefill"), ("b", 4, "prefill")]
    advance(out)
    out = s.schedule()  # a decodes, b finishes its prompt, c fills the rest
    assert plan(out) == [("a", 1, "decode"), ("b", 3, "prefill"), ("c", 3, "prefill")]


def test_without_chunking_a_prompt_that_does_not_fit_waits():
    s = make(max_num_batched_tokens=20, enable_chunked_prefill=False)
    add(s, "a", 6), add(s, "b", 12, max_tokens=2), add(s, "c", 2)
    out = s.schedule()
    assert plan(out) == [("a", 6, "prefill"), ("b", 12, "prefill"), ("c", 2, "prefill")]
    s2 = make(max_num_batched_tokens=14, enable_chunked_prefill=False)
    add(s2, "a", 6, max_tokens=2), add(s2, "b", 12, max_tokens=2), add(s2, "c", 2)
    assert plan(s2.schedule()) == [("a", 6, "prefill")]  # b does not fit; fcfs: c waits behind it


def _tail_preemption():
    """Five blocks of 4, budget 8, two running at most. a (4 + 10) and c (8 + 10) run; d and e wait
    behind max_num_seqs (budget is left for d). In step 5 a needs a third block; the tail c (3 blocks)
    is preempted."""
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    a, c = add(s, "a", 4, max_tokens=10), add(s, "c", 8, max_tokens=10)
    for step in range(5):
        if step == 1:
            add(s, "d", 1, max_tokens=10), add(s, "e", 2, max_tokens=10)
        out = s.schedule()
        assert not out.preempted
        advance(out)
    return s, a, c


def test_preempts_the_tail_to_the_front_of_a_waiting_queue_and_admits_nobody_in_that_step():
    s, a, c = _tail_preemption()
    assert ids(s.waiting) == ["d", "e"]  # max_num_seqs caps admission
    blocks = list(c.block_ids)
    out = s.schedule()
    assert preempted(out) == ["c"] and plan(out) == [("a", 1, "decode")]
    # c's blocks are freed tail first: a takes the first one freed, c's tail; the rest wait in that order.
    assert a.block_ids[-1] == blocks[-1] and list(s.pool.free_queue) == blocks[:-1][::-1]
    # Two blocks are free, 7 tokens of budget are left, one seat: c could come back with a 7-token
    # chunk right away. It must not: memory is short, admitting now would thrash.
    assert s.pool.num_free == 2 and len(s.running) == 1
    assert ids(s.waiting) == ["c", "d", "e"], "the victim goes to the FRONT of the waiting queue"
    assert c.num_computed == 0 and c.num_preemptions == 1 and not c.block_ids and c.status.value == "waiting"
    advance(out)
    out = s.schedule()  # the victim is the first to come back, before d and e
    assert plan(out) == [("a", 1, "decode"), ("c", 7, "recompute")]


def test_chunk_kind_is_judged_by_where_the_chunk_starts():
    # A one-token prompt chunk (start 5) is a prefill, not a decode.
    r = Request("r", list(range(6)), SamplingParams(max_tokens=8))
    r.output_ids = [1, 2]  # 8 tokens: 6 of prompt, 2 of output
    starts = (0, 3, 5, 6, 7)
    assert [r.chunk_kind(i) for i in starts] == ["prefill"] * 3 + ["decode"] * 2
    r.num_preemptions, r.recompute_until = 1, 7  # preempted with 7 tokens of KV, all lost
    assert [r.chunk_kind(i) for i in starts] == ["recompute"] * 4 + ["decode"]  # 7: new work again
    r.recompute_until = 4  # only 4 had KV: the rest of the prompt is a prefill, as it was
    assert [r.chunk_kind(i) for i in starts] == ["recompute", "recompute", "prefill", "decode", "decode"]


def test_priority_preemption_admits_nobody_not_even_a_more_urgent_newcomer():
    s = make("priority", num_blocks=5, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
    add(s, "a", 4, max_tokens=10, priority=1), add(s, "c", 8, max_tokens=10, priority=2)
    for _ in range(5):
        advance(s.schedule())
    add(s, "d", 1, max_tokens=10, priority=0)  # fits the 2 free blocks and the budget left
    out = s.schedule()
    assert preempted(out) == ["c"] and plan(out) == [("a", 1, "decode")]
    assert ids(s.waiting) == ["c", "d"]  # the victim at the front; by priority d goes first
    advance(out)
    assert plan(s.schedule()) == [("a", 1, "decode"), ("d", 1, "prefill")]  # then d, before c


def test_victim_is_the_request_being_scheduled_stops_the_pass():
    s = make(num_blocks=3, block_size=4, max_num_batched_tokens=32)
    add(s, "a", 3, max_tokens=2), add(s, "b", 8, max_tokens=2)
    advance(s.schedule())  # a: 1 block, b: 2 blocks, pool empty
    out = s.schedule()  # a's 4th token fits its block; b needs a 3rd block: the tail is b itself
    assert preempted(out) == ["b"]
    assert plan(out) == [("a", 1, "decode")] and ids(s.running) == ["a"]


def test_prefix_cache_hit_is_reused_not_recomputed():
    s = make(block_size=4, max_num_batched_tokens=64)
    a = add(s, "a", 9)
    advance(s.schedule())
    s.pool.cache_blocks(a.block_ids, s.hashes(a, 2))  # the engine names a's two full blocks
    twin = Request("twin", list(a.prompt_ids[:8]), SamplingParams(max_tokens=4), seq=500, arrival_time=500.0)
    s.add_request(twin)
    other = add(s, "other", 100)
    out = s.schedule()
    chunk = next(c for c in out.chunks if c.request is twin)
    # 8 tokens: 1 cached block (not 2: the last token must run to give logits). The chunk starts
    # at the hit, the budget pays only for the 4 tokens computed, the block is shared.
    assert (chunk.start, chunk.n, twin.num_computed) == (4, 4, 4)
    assert twin.num_cached_tokens == 4 and twin.block_ids[0] == a.block_ids[0]
    assert s.pool.ref_count[a.block_ids[0]] == 2
    assert plan(out) == [("a", 1, "decode"), ("twin", 4, "prefill"), ("other", 64 - 1 - 4, "prefill")]
    assert other.num_computed == 0


def test_a_request_whose_blocks_cannot_all_be_had_leaves_its_prefix_hit_untouched():
    """vLLM checks for all the blocks before it takes a hit (kv_cache_manager.py allocate_slots): a
    hit taken and given back would move the cached blocks to the back of the free queue, as if used."""
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a, c = add(s, "a", 9, max_tokens=1), add(s, "c", 9, max_tokens=1)
    advance(s.schedule())
    held = {r.request_id: list(r.block_ids) for r in (a, c)}
    for r in (a, c):
        s.pool.cache_blocks(r.block_ids, s.hashes(r, 2))
        s.finish(r, "length")
    add(s, "big", 15, max_tokens=4)  # four of the eight blocks: the two never used, a's and c's unnamed tails
    advance(s.schedule())
    order = list(s.pool.free_queue)
    assert order == held["a"][1::-1] + held["c"][1::-1]  # the named blocks, each request's tail first, a's first
    assert s.pool.lookup(s.hashes(a, 2)) == held["a"][:2]
    b = Request("b", a.prompt_ids[:8] + list(range(5000, 5012)), SamplingParams(max_tokens=2), seq=900,
                arrival_time=900.0)
    s.add_request(b)  # hits a's two cached blocks, needs three more: only two would be left
    out = s.schedule()
    assert plan(out) == [("big", 1, "decode")] and ids(s.waiting) == ["b"]
    assert list(s.pool.free_queue) == order  # the hit was never taken, so nothing moved
    assert (b.block_ids, b.num_computed) == ([], 0) and all(s.pool.ref_count[x] == 0 for x in held["a"][:2])
    s.pool.check()


@pytest.mark.parametrize("reserve", [False, True])
def test_reserve_full_isl_admits_a_prompt_only_when_all_of_it_fits(reserve):
    """vLLM's scheduler_reserve_full_isl: a waiting request is admitted only if blocks for its whole
    prompt are free, not only for its first chunk (off, the classic rule: the first chunk is enough)."""
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=9, scheduler_reserve_full_isl=reserve)
    add(s, "a", 7, max_tokens=4)
    advance(s.schedule())
    b = add(s, "b", 12, max_tokens=1)  # three blocks in all; its first chunk of 8 tokens needs the two free ones
    out = s.schedule()
    assert plan(out) == [("a", 1, "decode")] + ([] if reserve else [("b", 8, "prefill")])
    assert ids(s.waiting) == (["b"] if reserve else []) and len(b.block_ids) == (0 if reserve else 2)


def test_priority_orders_waiting_by_priority_not_by_arrival():
    s = make(policy="priority", num_blocks=16, block_size=4, max_num_batched_tokens=32)
    add(s, "low", 4, priority=5), add(s, "high", 4, priority=0), add(s, "mid", 7, priority=1)
    assert plan(s.schedule()) == [("high", 4, "prefill"), ("mid", 7, "prefill"), ("low", 4, "prefill")]


def _victim_before_the_requester(policy):
    """The victim sits at the head of the running queue and was already scheduled in this step.

    priority: low (priority 5) arrives first and runs alone; urgent, c and d arrive a step later.
    In step 2 c needs a second block: the least urgent, low, is at index 0 and already got its token.
    conservative: a, b, c, d start together; in step 1 c needs a second block; the victim is the
    decode with the least output and then the longest prompt: a, at index 0, already scheduled.
    """
    if policy == "priority":
        s = make("priority", num_blocks=5, block_size=4, max_num_batched_tokens=8)
        add(s, "low", 4, max_tokens=10, priority=5)
        advance(s.schedule())
        add(s, "urgent", 1, max_tokens=10, priority=0), add(s, "c", 4, max_tokens=10, priority=1)
        add(s, "d", 10, max_tokens=10, priority=2)
        out = s.schedule()
        assert plan(out) == [("low", 1, "decode"), ("urgent", 1, "prefill"), ("c", 4, "prefill"),
                             ("d", 2, "prefill")]
    else:
        s = make("conservative", num_blocks=5, block_size=4, max_num_batched_tokens=16)
        for rid, n in [("a", 7), ("b", 1), ("c", 4), ("d", 2)]:
            add(s, rid, n, max_tokens=2)
        out = s.schedule()
        assert [rid for rid, _, _ in plan(out)] == ["a", "b", "c", "d"]
    assert s.pool.num_free == 0
    advance(out)
    return s


@pytest.mark.parametrize("policy, victim, chunks", [
    # low's decode is taken back (1 token returns to the budget: 8 - 1 - 1 = 6 for d), and the
    # request after c, d, still gets its turn although the queue shifted under the pass.
    ("priority", "low", [("urgent", 1, "decode"), ("c", 1, "decode"), ("d", 6, "prefill")]),
    ("conservative", "a", [("b", 1, "decode"), ("c", 1, "decode"), ("d", 1, "decode")]),  # the longest prompt
])
def test_a_victim_earlier_in_the_queue_gives_its_tokens_back_and_nobody_is_skipped(policy, victim, chunks):
    s = _victim_before_the_requester(policy)
    out = s.schedule()
    assert preempted(out) == [victim] and plan(out) == chunks
    assert out.num_tokens == sum(n for _, n, _ in chunks)


def test_conservative_victim_being_scheduled_leaves_the_rest_their_turn():
    """Conservative picks the decode with the least output, then the longest prompt: here the
    head, while it is the request being scheduled. The request after it still runs in that step."""
    s = make(policy="conservative", num_blocks=3, block_size=7, max_num_batched_tokens=16)
    a, _ = add(s, "a", 14, max_tokens=2), add(s, "b", 1, max_tokens=2)
    out = s.schedule()  # a: 14 tokens in 2 blocks, b: 1 token in the third
    assert plan(out) == [("a", 14, "prefill"), ("b", 1, "prefill")]
    advance(out)
    out = s.schedule()  # a needs a third block: none. Victim: a (same output, longer prompt).
    assert preempted(out) == ["a"] and a.num_computed == 0
    assert plan(out) == [("b", 1, "decode")]


def test_priority_aging_lets_an_old_request_through():
    s = make(policy="priority", priority_aging=1.0, max_num_seqs=1, max_num_batched_tokens=4)
    add(s, "old", 4, priority=3, t=0.0)
    for step in range(6):
        add(s, f"new{step}", 4, priority=0, t=step + 1.0)
        out = s.schedule()
        for c in out.chunks:
            s.finish(c.request, "length")
        if any(c.request.request_id == "old" for c in out.chunks):
            break
    else:
        raise AssertionError("aging never served the old request")
    assert step >= 3  # it waited until its effective priority beat the newcomers'


def test_static_admits_a_new_batch_only_when_the_old_one_is_done():
    s = make(policy="static", max_num_batched_tokens=64)
    add(s, "a", 4, max_tokens=1), add(s, "b", 4, max_tokens=3)
    advance(s.schedule())
    s.finish(s.running[0], "length")  # a is done, b is not
    add(s, "c", 4)
    assert plan(s.schedule()) == [("b", 1, "decode")]
    s.finish(s.running[0], "length")
    assert plan(s.schedule()) == [("c", 4, "prefill")]


def test_conservative_new_token_ratio_decays_each_quiet_step_to_its_floor():
    s = make(policy="conservative", num_blocks=64, max_num_batched_tokens=64, new_token_ratio_decay=0.05,
             init_new_token_ratio=0.7, min_new_token_ratio=0.55)
    add(s, "a", 4, max_tokens=50)
    ratios = []
    for _ in range(5):
        advance(s.schedule())
        ratios.append(s.new_token_ratio)
    assert ratios == pytest.approx([0.65, 0.6, 0.55, 0.55, 0.55])  # down by the decay, floored


def test_the_policy_picks_the_class_and_a_learners_subclass_stays_itself(tiny):
    classes = {"fcfs": Scheduler, "priority": PriorityScheduler, "conservative": ConservativeScheduler,
               "static": StaticScheduler}
    for policy, cls in classes.items():
        assert scheduler_class(policy) is cls and type(LLMEngine(tiny, policy=policy).scheduler) is cls

    class Mine(Scheduler):  # a learner's class runs as written, whatever the policy
        pass

    assert type(LLMEngine(tiny, policy="priority", scheduler_cls=Mine).scheduler) is Mine


def test_preemptions_are_counted_per_request_and_finished_requests_leave_no_state():
    """A long-lived scheduler keeps nothing of a finished request (its arrival step for aging included),
    and a second finish (an abort racing a stop) finds nothing left to free."""
    # Four 4-token prompts growing to 16 tokens in a 5-block pool: the tail is preempted again and again.
    s = make(num_blocks=5, block_size=4)
    reqs = [add(s, rid, 4, max_tokens=12) for rid in "abcd"]
    seen = {r.request_id: 0 for r in reqs}
    while s.has_unfinished():
        out = s.schedule()
        for r in out.preempted:
            seen[r.request_id] += 1
        advance(out)
        for r in reqs:
            if not r.is_finished and len(r.output_ids) == 12:
                s.finish(r, "length")
    assert seen == {"a": 0, "b": 1, "c": 2, "d": 2}
    assert {r.request_id: r.num_preemptions for r in reqs} == seen
    assert all(s.steps_waited(r) == 0 for r in reqs) and s.pool.num_free == 5
    s.finish(reqs[0], "abort")
    assert s.pool.num_free == 5 and not s.has_unfinished()
    s.pool.check()


def assert_work_conserving(s, before, behind, out):
    """Budget left over means nobody still running went without: every request running before and
    after the step got a chunk, and, in a step without preemption, all it was behind."""
    if out.num_tokens < s.config.max_num_batched_tokens:
        served = {id(c.request) for c in out.chunks}
        assert all(id(r) in served for r in before if r in s.running)
        if not out.preempted:
            assert all(c.n == behind[id(c.request)] for c in out.chunks if id(c.request) in behind)


def _random_scenario(rng, policy):
    s = make(policy, num_blocks=rng.randint(4, 10), block_size=rng.choice([2, 4]),
             max_num_batched_tokens=rng.randint(3, 16), max_num_seqs=rng.randint(2, 5))
    shared = list(range(500, 508))  # some prompts share a prefix: hits, and hits given back
    arrivals = {}
    for k in range(rng.randint(2, 6)):
        prompt = (shared[:rng.choice([0, 4, 8])] + [rng.randint(1, 400) for _ in range(rng.randint(1, 8))])
        arrivals.setdefault(rng.randint(0, 4), []).append(
            Request(f"r{k}", prompt, SamplingParams(max_tokens=rng.randint(1, 8)), priority=rng.randint(0, 4),
                    arrival_time=float(k), seq=k))
    return s, arrivals


@pytest.mark.parametrize("policy", ["fcfs", "priority", "conservative"])
def test_every_step_keeps_the_schedulers_invariants_in_random_scenarios(policy):
    """Seeded random pools, budgets, shared prefixes, priorities and arrivals over time; each step:
    the running requests' chunks in queue order, nobody twice, no empty chunk, the budget kept and
    spent before a running request is cut short; an
    admitted request is RUNNING from its hit, a victim is WAITING with nothing; num_cached_tokens is
    the first admission's hit, never a re-admission's."""
    rng, seen = random.Random(policy), {"victim ahead": 0, "re-admitted with a hit": 0}
    for _ in range(300):
        s, arrivals = _random_scenario(rng, policy)
        reqs, first_hit = [], {}
        for step in range(300):
            for req in arrivals.get(step, []):
                try:
                    s.add_request(req)
                except ValueError:  # can never fit this pool: refused, as it should be
                    continue
                reqs.append(req)
            before = list(s.running)
            behind = {id(r): r.num_behind for r in before}
            out = s.schedule()
            chunks = [c.request for c in out.chunks]
            assert_work_conserving(s, before, behind, out)
            assert len(set(map(id, chunks))) == len(chunks) and all(c.n >= 1 for c in out.chunks)
            assert out.num_tokens <= s.config.max_num_batched_tokens
            ran = [r for r in chunks if r in before]
            assert ran == [r for r in before if r in ran]
            for c in out.chunks:
                assert c.request.status is RequestStatus.RUNNING and c.request.num_computed == c.start
                if c.request not in before:
                    first_hit.setdefault(c.request.request_id, c.start)
                    seen["re-admitted with a hit"] += c.request.num_preemptions > 0 and c.start > 0
            for v in out.preempted:
                assert v.status is RequestStatus.WAITING and not v.block_ids and v.num_computed == 0
                seen["victim ahead"] += any(before.index(v) < before.index(c.request)
                                            for c in out.chunks if c.request in before)
            advance(out)
            for c in out.chunks:
                r = c.request
                s.pool.cache_blocks(r.block_ids, s.hashes(r, r.num_computed // s.block_size), c.start // s.block_size)
            for r in reqs:
                if not r.is_finished and len(r.output_ids) >= r.sampling_params.max_tokens:
                    s.finish(r, "length")
            if step > 4 and not s.has_unfinished():
                break
        assert not s.has_unfinished() and s.pool.num_free == s.pool.num_blocks
        assert {r.request_id: r.num_cached_tokens for r in reqs if r.request_id in first_hit} == first_hit
    if policy == "fcfs":  # fcfs preempts the tail: a victim is never ahead of the requester
        assert seen.pop("victim ahead") == 0
    assert all(seen.values()), seen  # the situations the invariants guard did happen


def test_conservative_ratio_after_a_retraction_is_what_the_survivors_have_written():
    """SGLang's re-estimate: (tokens the survivors decoded + retract_decode_steps per survivor) / their
    max_tokens, capped at 1. Numbers by hand: two survivors with 9 outputs each of 30, 3 steps each."""
    s = make(policy="conservative", num_blocks=9, block_size=4, max_num_batched_tokens=64,
             init_new_token_ratio=0.1, min_new_token_ratio=0.1, new_token_ratio_decay=0.0, retract_decode_steps=3)
    for rid in "abc":
        add(s, rid, 4, max_tokens=30)
    for _ in range(40):
        out = s.schedule()
        if out.preempted:
            break
        advance(out)
    assert preempted(out) == ["a"] and [(r.request_id, len(r.output_ids)) for r in s.running] == [("b", 9), ("c", 9)]
    assert s.new_token_ratio == pytest.approx((9 + 9 + 3 * 2) / (30 + 30)) == 0.4


@pytest.mark.parametrize("max_tokens, admitted", [(23, True), (24, False)])
def test_conservative_admits_exactly_up_to_its_headroom(max_tokens, admitted):
    """Headroom = free slots - what the running requests will still write (remaining output x ratio).
    By hand: 14 free blocks of 4 = 56 slots; a has 9 of 10 outputs to go, x 0.5 = 4.5: headroom 51.5.
    b needs its 40 prompt tokens + max_tokens x 0.5: 51.5 fits exactly, 52 does not."""
    s = make(policy="conservative", num_blocks=16, block_size=4, max_num_batched_tokens=128,
             init_new_token_ratio=0.5, min_new_token_ratio=0.5, new_token_ratio_decay=0.0)
    add(s, "a", 4, max_tokens=10)
    advance(s.schedule())
    add(s, "b", 40, max_tokens=max_tokens)
    out = s.schedule()
    assert s.headroom == (56 - 4.5) - (40 + max_tokens * 0.5 if admitted else 0)
    assert plan(out) == [("a", 1, "decode")] + ([("b", 40, "prefill")] if admitted else [])


def test_the_prefix_cache_counters_add_up_over_admissions():
    # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up and found, summed. The hit
    # covers every full block before the last prompt token: the same 9 tokens (2 * 4 + 1) hit 8.
    s = make(block_size=4)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_steps) == (0, 0, 0)
    first = add(s, "a", 9)
    advance(s.schedule())
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (9, 0)
    s.pool.cache_blocks(first.block_ids, s.hashes(first, 2))  # the engine names its two full blocks
    s.finish(first, "stop")
    again = [Request(f"b{i}", list(first.prompt_ids) + [5] * i, SamplingParams(max_tokens=4),
                     arrival_time=1e9 + i, seq=10**6 + i) for i in range(2)]
    for r in again:
        s.add_request(r)
    s.schedule()
    assert [r.num_cached_tokens for r in again] == [8, 8]  # two full blocks of the first prompt each
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_steps) == (9 + 9 + 10, 16, 2)
