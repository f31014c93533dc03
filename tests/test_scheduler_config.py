"""SchedulerConfig refuses bad settings when it is made, naming the field and the value (numpy
values are fine); a request that could never be scheduled without chunked prefill is refused at add_request,
with the exact bound."""

import numpy as np
import pytest

from nano_engine import BlockPool, EngineConfig, LLMEngine, Request, SamplingParams, Scheduler, SchedulerConfig

NAN = float("nan")


@pytest.mark.parametrize("kw, error, match", [
    (dict(max_num_batched_tokens=0), ValueError, r"max_num_batched_tokens=0"),
    (dict(max_num_batched_tokens=True), TypeError, r"max_num_batched_tokens=True"),
    (dict(max_num_seqs=-2), ValueError, r"max_num_seqs=-2"),
    (dict(max_num_seqs="4"), TypeError, r"max_num_seqs='4'"),
    (dict(enable_chunked_prefill=0), TypeError, r"enable_chunked_prefill=0"),
    (dict(scheduler_reserve_full_isl="yes"), TypeError, r"scheduler_reserve_full_isl='yes'"),
    (dict(policy="lifo"), ValueError, r"policy='lifo'"),
    (dict(priority_aging=NAN), ValueError, r"priority_aging=nan"),
    (dict(priority_aging=-1.0), ValueError, r"priority_aging=-1.0"),
    (dict(priority_aging=True), TypeError, r"priority_aging=True"),
    (dict(init_new_token_ratio=0.0), ValueError, r"init_new_token_ratio=0.0"),
    (dict(init_new_token_ratio=1.5), ValueError, r"init_new_token_ratio=1.5"),
    (dict(min_new_token_ratio=0.0), ValueError, r"min_new_token_ratio=0.0"),
    (dict(min_new_token_ratio=NAN), ValueError, r"min_new_token_ratio=nan"),
    (dict(min_new_token_ratio=0.8), ValueError, r"min_new_token_ratio=0.8.*init_new_token_ratio"),
    (dict(new_token_ratio_decay=-0.001), ValueError, r"new_token_ratio_decay=-0.001"),
    (dict(new_token_ratio_decay=NAN), ValueError, r"new_token_ratio_decay=nan"),
    (dict(retract_decode_steps=0), ValueError, r"retract_decode_steps=0"),
])
def test_bad_scheduler_settings(kw, error, match):
    with pytest.raises(error, match=match):
        SchedulerConfig(**kw)
    with pytest.raises(error, match=match):  # the engine's flat settings reach the same check
        EngineConfig.from_settings(**kw)


def test_numpy_settings_are_fine_and_normalized(tiny):
    cfg = SchedulerConfig(max_num_batched_tokens=np.int64(64), max_num_seqs=np.int32(4),
                          enable_chunked_prefill=np.bool_(False), priority_aging=np.float32(0.5),
                          retract_decode_steps=np.uint8(5))
    assert cfg == SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False,
                                  priority_aging=0.5, retract_decode_steps=5)
    assert type(cfg.max_num_batched_tokens) is int and type(cfg.enable_chunked_prefill) is bool
    assert type(cfg.priority_aging) is float
    engine = LLMEngine(tiny, max_num_batched_tokens=np.int64(16), policy="priority", priority_aging=1)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].output_ids


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
