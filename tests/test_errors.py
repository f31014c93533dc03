"""Bad input gets a ValueError that names the value and the limit, and leaves the engine usable."""

import pytest

from nano_engine import EngineConfig, LLMEngine, SamplingParams


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=0), r"max_tokens=0 must be an integer >= 1"),
    (dict(temperature=-0.5), r"temperature=-0.5"),
    (dict(temperature=float("nan")), r"temperature=nan"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(top_k=-1), r"top_k=-1"),
    (dict(seed=1.5), r"seed=1.5"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 must be an integer >= 1"),
    (dict(max_num_seqs=0), r"max_num_seqs=0"),
    (dict(num_blocks=0), r"num_blocks=0"),
    (dict(block_size=-4), r"block_size=-4"),
    (dict(policy="lifo"), r"policy='lifo' is not one of"),
    (dict(priority_aging=-1.0), r"priority_aging=-1.0"),
    (dict(max_num_seqs=2.5), r"max_num_seqs=2.5"),
])
def test_bad_engine_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_bad_requests_are_refused_at_add_request(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"token id 64 is outside the vocabulary \[0, 64\)"):
        engine.add_request([1, 64])
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        engine.add_request([-1])
    with pytest.raises(ValueError, match=r"can never fit: prompt 10 \+ max_tokens 8 needs 5 blocks "
                                         r"of 4 tokens, the pool has 4"):
        engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request([3], request_id="x")
    # Nothing was lost: the good request runs to completion.
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[rid].output_ids) == 2


def test_without_chunking_a_request_larger_than_the_budget_is_refused(tiny):
    engine = LLMEngine(tiny, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"without chunked prefill.*max_num_batched_tokens=8"):
        engine.add_request(list(range(1, 8)), SamplingParams(max_tokens=4))


def test_request_longer_than_the_model_is_refused(tiny):
    engine = LLMEngine(tiny, num_blocks=1024)
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        engine.add_request([1] * 4000, SamplingParams(max_tokens=200))


def test_generate_is_all_or_nothing(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="can never fit"):
        engine.generate([[1, 2], list(range(1, 30))], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and engine.block_pool.num_free == 4


def test_abort_frees_everything(tiny):
    engine = LLMEngine(tiny, num_blocks=16, block_size=4)
    a = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))
    b = engine.add_request(list(range(1, 4)), SamplingParams(max_tokens=20))
    engine.step()
    assert engine.block_pool.num_free < 16
    engine.abort(a)
    engine.abort(b)
    assert engine.requests[a].finish_reason == "abort" and not engine.has_unfinished()
    assert engine.block_pool.num_free == 16 and not engine.requests[a].block_ids
    with pytest.raises(KeyError, match="no request with id 'zzz'"):
        engine.abort("zzz")
