"""Prefix caching through the engine: every block that fills is named, and a hit is reused, not recomputed.

Both mistakes leave the outputs right (the KV of a recomputed prefix is the same KV), so these tests
look at what the engine computed: which blocks the prefix cache can find after each step, where a
request's first chunk starts and how many tokens the step spent on it.
"""

from nano_engine import LLMEngine, SamplingParams
from nano_engine.paged import block_hashes


def cached_prefix(engine, req) -> int:
    """How many of the request's full, computed blocks the prefix cache finds under their hashes."""
    bs = engine.config.cache_config.block_size
    full = req.num_computed // bs
    return len(engine.block_pool.lookup(block_hashes(req.all_token_ids, bs, full)))


def test_every_block_that_fills_is_named_also_in_the_middle_of_a_chunk(tiny):
    engine = LLMEngine(tiny, block_size=4, max_num_batched_tokens=10)
    rid = engine.add_request(list(range(1, 14)), SamplingParams(max_tokens=3))
    req = engine.requests[rid]
    seen = []
    while engine.has_unfinished():
        engine.step()
        if not req.is_finished:
            seen.append((req.num_computed, cached_prefix(engine, req)))
    # Tokens 0..9 fill blocks 0 and 1 (both before the chunk's end), tokens 10..12 fill block 2
    # in the middle of the chunk; the decode of token 13 fills nothing.
    assert seen == [(10, 2), (13, 3), (14, 3)]


def test_a_prefix_hit_starts_at_the_hit_and_costs_only_the_rest(tiny):
    engine = LLMEngine(tiny, block_size=4, max_num_batched_tokens=64)
    system = list(range(1, 14))  # 13 tokens: three full blocks
    first = engine.requests[engine.add_request(system + [20, 21], SamplingParams(max_tokens=4))]
    engine.step()
    second = engine.requests[engine.add_request(system + [30, 31, 32], SamplingParams(max_tokens=2))]
    batches = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: batches.append(batch) or forward(batch)
    engine.step()
    # The first request decodes; the second finds 12 cached tokens and computes only its last 4:
    # the model sees 5 new tokens, on top of 15 and 12 cached ones, and the blocks are shared.
    assert batches[0].num_tokens == 5 and batches[0].num_cached == [15, 12]
    assert second.num_cached_tokens == 12 and second.block_ids[:3] == first.block_ids[:3]
    alone = LLMEngine(tiny, block_size=4).generate([system + [30, 31, 32]], SamplingParams(max_tokens=2))[0]
    engine.step()
    assert second.output_ids == alone.output_ids


def test_a_cache_salt_shares_a_prefix_only_between_requests_with_the_same_salt(tiny):
    engine = LLMEngine(tiny, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 14))  # three full blocks before the last token
    hits = {}
    for rid, salt in [("a", "alice"), ("b", "bob"), ("c", None), ("d", "alice"), ("e", None)]:
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        hits[rid] = engine.requests[rid].num_cached_tokens
    assert hits == {"a": 0, "b": 0, "c": 0, "d": 12, "e": 12}
