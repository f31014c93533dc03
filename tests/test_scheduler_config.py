"""Without chunked prefill a request must fit one step whatever happens to it: one that could never
be scheduled is refused at add_request, with the exact bound (prompt + max_tokens - 1), and one at the
bound runs. (Bad SchedulerConfig values are test_api_properties.py's: every engine setting, at random.)"""

import pytest

from nano_engine import BlockPool, LLMEngine, Request, SamplingParams, Scheduler, SchedulerConfig


def _unchunked(budget):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=False),
                     BlockPool(16), block_size=4)


def test_without_chunking_the_bound_is_prompt_plus_max_tokens_minus_one():
    """The largest step a request can need is the recompute of prompt + max_tokens - 1 tokens after a
    preemption just before its last token (the last sampled token is never fed back)."""
    with pytest.raises(ValueError, match=r"'over'.*prompt 4 \+ max_tokens 5 - 1 = 8 .*max_num_batched_tokens=7"):
        _unchunked(7).add_request(Request("over", [1, 2, 3, 4], SamplingParams(max_tokens=5)))
    s = _unchunked(8)
    a = Request("at", [1, 2, 3, 4], SamplingParams(max_tokens=5))
    s.add_request(a)  # exactly at the bound: accepted
    while len(a.output_ids) < 4:  # run it to its last token, as the engine would
        for c in s.schedule().chunks:
            c.request.num_computed = c.start + c.n
            c.request.output_ids.append(7)
    s.preempt(a)  # the worst moment: 8 tokens to recompute, and they fit one step
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.n, c.kind) for c in out.chunks] == [("at", 0, 8, "recompute")]


def test_without_chunking_a_request_at_the_bound_runs_through_the_engine(tiny):
    engine = LLMEngine(tiny, max_num_batched_tokens=8, enable_chunked_prefill=False, num_blocks=5, block_size=2)
    with pytest.raises(ValueError, match=r"prompt 4 \+ max_tokens 6 - 1 = 9 tokens"):
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6))
    reqs = engine.generate([[1, 2, 3, 4], [5, 6, 7, 8]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(r.output_ids) for r in reqs] == [5, 5] and engine.stats.preemptions > 0
