"""The public API under random, often wrong, arguments: each call either succeeds or raises a
ValueError or TypeError whose message names the argument; a refused request changes nothing.

Covers SamplingParams' fields, EngineConfig's own fields (through LLMEngine(...)) and
add_request's arguments (prompt forms, sampling_params, request_id, priority, arrival_time).
"""

from functools import lru_cache

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nano_engine import LLMEngine, SamplingParams
from nano_engine.tiny import tiny_model

MODEL = tiny_model(seed=3, num_layers=1)
VOCAB = MODEL.config.vocab_size
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values of every kind a caller might pass by mistake.
wild = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3), st.binary(max_size=2),
    st.integers(-5, 70).map(np.int64), st.integers(0, 70).map(np.uint8),
    st.floats(-2, 2, width=32).map(np.float32), st.sampled_from([np.bool_(True), np.nan]),
    st.integers(-3, 70).map(torch.tensor), st.floats(-1, 2).map(torch.tensor),
    st.lists(st.integers(-3, 70), max_size=3), st.just({"a": 1}), st.just(object()),
)


def outcome(call, fields):
    """Run call(); success, or a ValueError / TypeError naming one of `fields`. Returns the result or None."""
    try:
        result = call()
    except (ValueError, TypeError) as e:
        named = [f for f in fields if f in str(e)]
        assert named, f"{type(e).__name__}({e}) names none of {fields}"
        event(f"refused, naming {named[0]}")
        return None
    event("accepted")
    return result


# ----- SamplingParams -----
SAMPLING_FIELDS = {
    "max_tokens": st.integers(-2, 10),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([1e-300, 1e-6, 1e-5, -0.0, -1e-9])),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([5e-324, 1e-45, 1.0 + 1e-12])),
    "top_k": st.integers(-2, 80),
    "seed": st.one_of(st.none(), st.integers(-2**64, 2**65)),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 80), max_size=3), st.lists(wild, max_size=2),
                                st.integers(0, 3).map(lambda n: np.arange(n)), st.just(torch.tensor([1.0]))),
    "ignore_eos": st.booleans(),
    "min_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 1.0])),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.sampled_from([0.0, 1.0, 5e-324])),
    "presence_penalty": st.one_of(st.floats(-3, 3), st.sampled_from([-2.0, 2.0])),
    "frequency_penalty": st.one_of(st.floats(-3, 3), st.sampled_from([-2.0, 2.0])),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(-2, 80), st.floats(-120, 120), max_size=3),
                            st.dictionaries(wild.filter(lambda v: v.__hash__ is not None), wild, max_size=2)),
    "min_tokens": st.integers(-2, 12),
    "logprobs": st.one_of(st.none(), st.integers(-2, 30)),
}


@st.composite
def sampling_kwargs(draw):
    """A few fields, each a plausible value or anything at all."""
    names = draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), unique=True, max_size=5))
    return {n: draw(st.one_of(SAMPLING_FIELDS[n], wild)) for n in names}


@FAST
@given(sampling_kwargs())
def test_sampling_params(kw):
    sp = outcome(lambda: SamplingParams(**kw), list(kw))
    if sp is not None:  # what was accepted is normalized to plain Python values in range
        assert type(sp.max_tokens) is int and sp.max_tokens >= 1
        assert type(sp.temperature) is float and sp.temperature >= 0
        assert type(sp.top_p) is float and 0 < sp.top_p <= 1
        assert type(sp.top_k) is int and sp.top_k >= 0
        assert sp.seed is None or type(sp.seed) is int
        assert all(type(t) is int and t >= 0 for t in sp.stop_token_ids)
        assert type(sp.ignore_eos) is bool
        assert type(sp.min_p) is float and 0 <= sp.min_p <= 1
        assert type(sp.repetition_penalty) is float and sp.repetition_penalty > 0
        assert all(type(v) is float and -2 <= v <= 2 for v in (sp.presence_penalty, sp.frequency_penalty))
        assert sp.logit_bias is None or (sp.logit_bias and all(
            type(t) is int and t >= 0 and type(b) is float and -100 <= b <= 100 for t, b in sp.logit_bias.items()))
        assert type(sp.min_tokens) is int and 0 <= sp.min_tokens <= sp.max_tokens
        assert sp.logprobs is None or (type(sp.logprobs) is int and sp.logprobs >= 0)
        torch.Generator().manual_seed(sp.seed or 0)  # any accepted seed is one torch takes


# ----- EngineConfig's fields, through LLMEngine(...) -----
ENGINE_FIELDS = {
    "num_blocks": st.one_of(st.integers(-1, 64), st.sampled_from([10**12, 2**70])),
    "block_size": st.integers(-1, 32),
    "enable_prefix_caching": st.booleans(),
    "step_log_size": st.integers(-2, 5),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_engine_config(data):
    names = data.draw(st.lists(st.sampled_from(sorted(ENGINE_FIELDS)), unique=True, min_size=1, max_size=3))
    kw = {n: data.draw(st.one_of(ENGINE_FIELDS[n], wild)) for n in names}
    engine = outcome(lambda: LLMEngine(MODEL, **kw), list(kw))
    if engine is not None:
        cfg, cache = engine.config, engine.config.cache_config
        assert all(type(v) is int for v in (cache.num_blocks, cache.block_size, cfg.step_log_size))
        assert type(cache.enable_prefix_caching) is bool
        assert engine.block_pool.num_free == cache.num_blocks and engine.step_log.maxlen == cfg.step_log_size


# ----- add_request -----
good_prompts = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10).flatmap(lambda p: st.sampled_from([
    p, tuple(p), np.array(p), np.array(p, dtype=np.int16), torch.tensor(p), torch.tensor(p, dtype=torch.int32),
    [np.int64(t) for t in p]]))
bad_prompts = st.one_of(
    st.lists(st.integers(-1, VOCAB), max_size=10),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4).flatmap(lambda p: st.sampled_from([
        np.array(p, dtype=np.float64), torch.tensor(p, dtype=torch.float32), torch.tensor([p]),
        [float(t) for t in p], [True] + p])),
    wild)
prompts = st.one_of(good_prompts, good_prompts, bad_prompts)  # one_of draws its branches about evenly
ADD_FIELDS = ["prompt_ids", "sampling_params", "request_id", "priority", "arrival_time", "max_tokens", "logit_bias",
              "logprobs"]


def snapshot(engine):
    s = engine.scheduler
    return ({k: (r.status, len(r.output_ids)) for k, r in engine.requests.items()},
            [r.request_id for r in s.waiting], [r.request_id for r in s.running], engine.block_pool.num_free,
            list(engine.block_pool.free_queue), engine._next_id, engine._num_added, list(engine._added))


@lru_cache(maxsize=None)
def alone(prompt: tuple, max_tokens: int) -> list[int]:
    return LLMEngine(MODEL).generate([list(prompt)], SamplingParams(max_tokens=max_tokens))[0].output_ids


ADD_ARGS = {  # argument: its plausible values (the wild ones are `wild`)
    "sampling_params": st.one_of(st.none(), st.builds(SamplingParams, max_tokens=st.integers(1, 100)),
                                 st.builds(SamplingParams, max_tokens=st.integers(1, 8), temperature=st.floats(0, 2),
                                           seed=st.integers(0, 9), logprobs=st.none() | st.integers(0, VOCAB + 2),
                                           logit_bias=st.dictionaries(st.integers(0, VOCAB + 2),
                                                                      st.floats(-100, 100), max_size=2),
                                           repetition_penalty=st.floats(0.5, 2), min_tokens=st.integers(0, 1))),
    "request_id": st.one_of(st.none(), st.sampled_from(["a", "b", "0", "1", ""])),
    "priority": st.integers(-3, 3),
    "arrival_time": st.one_of(st.none(), st.floats(0, 1e9)),
}


@FAST
@given(st.data())
def test_add_request(data):
    # A small pool (96 slots: the default 64 tokens fit, 100 do not) and a short budget.
    engine = LLMEngine(MODEL, num_blocks=24, block_size=4, max_num_batched_tokens=16)
    for _ in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(prompts)
        kw = {}
        for name, plausible in ADD_ARGS.items():  # each argument absent, plausible or wild
            kind = data.draw(st.sampled_from(["absent", "plausible", "wild"]))
            if kind != "absent":
                kw[name] = data.draw(plausible if kind == "plausible" else wild)
        before = snapshot(engine)
        rid = outcome(lambda: engine.add_request(prompt, **kw), ADD_FIELDS)
        if rid is None:
            assert snapshot(engine) == before, "a refused request changed the engine"
        else:
            req = engine.requests[rid]
            assert type(rid) is str and rid and req.prompt_ids
            assert rid == kw["request_id"] if kw.get("request_id") is not None else rid.isdigit()
            assert all(type(t) is int and 0 <= t < VOCAB for t in req.prompt_ids)
            assert type(req.priority) is int and type(req.arrival_time) is float
        if engine.has_unfinished():
            engine.step()
    # The engine still runs a good request to the tokens it gets alone.
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[good].output_ids == alone((5, 6, 7), 4)
    assert engine.block_pool.num_free == 24
