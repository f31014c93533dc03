"""The public API under random, often wrong, arguments: each call either succeeds or raises a
ValueError or TypeError whose message names the argument (and, for SamplingParams and add_request,
begins with it: the server's 400 takes its `param` from that word); a refused request changes
nothing; what is accepted is the value given, as a plain Python value.

Covers SamplingParams' fields, every EngineConfig setting (the cache's and the scheduler's, through
LLMEngine(...)) and add_request's arguments (prompt forms, sampling_params, request_id, priority,
arrival_time, cache_salt). This file owns "every bad value is refused"; the tables in
test_errors.py keep what a refusal must name (the value, the limit) and the cases no generator reaches.
"""

from functools import lru_cache

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nano_engine import LLMEngine, SamplingParams, scheduler_class
from nano_engine.request import SEED_MAX, SEED_MIN
from nano_engine.scheduler import POLICIES
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
    st.sampled_from([torch.tensor(True), torch.tensor([1, 2])]),
    st.lists(st.integers(-3, 70), max_size=3), st.just({"a": 1}), st.just(object()),
)
# Values of the wrong kind that pass for the right one: a bool for a number, a number for a flag, 2.0 for 2.
near_miss = st.sampled_from([True, False, np.bool_(True), torch.tensor(True), 0, 1, np.int64(1), 2.0, np.float32(1.0),
                             torch.tensor(2.0)])


def outcome(call, fields, lead=True):
    """Run call(); success, or a ValueError / TypeError naming one of `fields` (with `lead`, first of all).
    Returns the result or None."""
    try:
        result = call()
    except (ValueError, TypeError) as e:
        named = [f for f in fields if (str(e).startswith(f) if lead else f in str(e))]
        assert named, f"{type(e).__name__}({e}) {'begins with' if lead else 'names'} none of {fields}"
        event(f"refused, naming {named[0]}")
        return None
    event("accepted")
    return result


def kept(got, given, kind: type) -> bool:
    """An accepted value is of its field's kind (a bool only a flag, an integer an int or a float, a float
    only a float: never 2.0 as 2, nor True as 1; numpy scalars and 0-d tensors as their value) and is kept
    at its value, as a plain Python value."""
    v = given.item() if isinstance(given, torch.Tensor) and given.ndim == 0 else given
    ok = (bool if isinstance(v, (bool, np.bool_)) else (int, float) if isinstance(v, (int, np.integer))
          else float if isinstance(v, (float, np.floating)) else ())
    assert type(got) is kind and issubclass(kind, ok) and got == given, (got, given, kind)
    return True


# ----- SamplingParams -----
SAMPLING_FIELDS = {
    "max_tokens": st.integers(-2, 10),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([1e-300, 1e-6, 1e-5, -0.0, -1e-9])),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([5e-324, 1e-45, 1.0 + 1e-12])),
    "top_k": st.integers(-2, 80),
    "seed": st.one_of(st.none(), st.integers(-2**64, 2**65), st.sampled_from([SEED_MIN - 1, SEED_MIN, SEED_MAX,
                                                                               SEED_MAX + 1])),
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
KINDS = {**dict.fromkeys(["max_tokens", "top_k", "seed", "min_tokens", "logprobs", "num_blocks", "block_size",
                          "step_log_size", "max_num_batched_tokens", "max_num_seqs", "retract_decode_steps"], int),
         **dict.fromkeys(["ignore_eos", "enable_prefix_caching", "enable_chunked_prefill",
                          "scheduler_reserve_full_isl"], bool)}  # the others: float (policy: str)


@st.composite
def sampling_kwargs(draw):
    """A few fields, each a plausible value (half the time), a near miss or anything at all."""
    names = draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), unique=True, max_size=4))
    return {n: draw(st.one_of(SAMPLING_FIELDS[n], SAMPLING_FIELDS[n], near_miss, wild)) for n in names}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_kwargs())
def test_sampling_params(kw):
    sp = outcome(lambda: SamplingParams(**kw), list(kw))
    if sp is not None:  # what was accepted is in range ...
        assert sp.max_tokens >= 1 and sp.temperature >= 0 and 0 < sp.top_p <= 1 and sp.top_k >= 0
        assert 0 <= sp.min_p <= 1 and sp.repetition_penalty > 0 and 0 <= sp.min_tokens <= sp.max_tokens
        assert -2 <= sp.presence_penalty <= 2 and -2 <= sp.frequency_penalty <= 2
        assert (sp.logprobs is None or sp.logprobs >= 0) and all(t >= 0 for t in sp.stop_token_ids)
        assert sp.logit_bias is None or (sp.logit_bias and all(t >= 0 and -100 <= b <= 100
                                                               for t, b in sp.logit_bias.items()))
        torch.Generator().manual_seed(sp.seed or 0)  # any accepted seed is one torch takes
        for name, value in kw.items():  # ... and is what was given
            got = getattr(sp, name)
            if name == "stop_token_ids":
                assert len(got) == len(value) and all(kept(g, t, int) for g, t in zip(got, value))
            elif name == "logit_bias":  # an empty bias is no bias (a token given twice is refused)
                given = {int(t): (t, b) for t, b in (value or {}).items()}
                assert len(got or {}) == len(given)
                assert all(kept(t, given[t][0], int) and kept(b, given[t][1], float) for t, b in (got or {}).items())
            elif value is None:  # seed, logprobs: not asked for
                assert got is None
            elif name == "top_k" and int(value) == -1:  # vLLM's other "no limit", read as 0
                assert type(got) is int and got == 0
            else:
                kept(got, value, KINDS.get(name, float))


# ----- EngineConfig's settings (the cache's and the scheduler's), through LLMEngine(...) -----
ratio = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 1.0]))
ENGINE_FIELDS = {
    "num_blocks": st.one_of(st.integers(-1, 64), st.sampled_from([10**12, 2**70])),  # larger than memory
    "block_size": st.integers(-1, 32),
    "enable_prefix_caching": st.booleans(),
    "step_log_size": st.one_of(st.integers(-2, 5), st.sampled_from([2**63 - 1, 2**63])),  # a deque's maxlen: C ssize_t
    "max_num_batched_tokens": st.integers(-1, 64),
    "max_num_seqs": st.integers(-2, 8),
    "enable_chunked_prefill": st.booleans(),
    "policy": st.sampled_from(POLICIES + ("lifo",)),
    "priority_aging": st.floats(-1, 2),
    "init_new_token_ratio": ratio, "min_new_token_ratio": ratio, "new_token_ratio_decay": ratio,
    "retract_decode_steps": st.integers(-1, 5),
    "scheduler_reserve_full_isl": st.booleans(),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_engine_config(data):
    names = data.draw(st.lists(st.sampled_from(sorted(ENGINE_FIELDS)), unique=True, min_size=1, max_size=4))
    kw = {n: data.draw(st.one_of(ENGINE_FIELDS[n], ENGINE_FIELDS[n], near_miss, wild)) for n in names}
    engine = outcome(lambda: LLMEngine(MODEL, **kw), list(kw), lead=False)  # the memory check names num_blocks
    if engine is not None:
        cfg, cache, s = engine.config, engine.config.cache_config, engine.config.scheduler_config
        assert not (s.policy == "static" and s.enable_chunked_prefill)  # static batching never chunks
        assert s.priority_aging >= 0 and 0 < s.min_new_token_ratio <= s.init_new_token_ratio <= 1
        assert 0 <= s.new_token_ratio_decay <= 1 and type(engine.scheduler) is scheduler_class(s.policy)
        for name, value in kw.items():  # each setting given is kept, at its value
            got = getattr(s if hasattr(s, name) else cache if hasattr(cache, name) else cfg, name)
            if name == "policy":
                assert got == value
            elif value is not None:  # None: the default (enable_chunked_prefill's: on, but for static)
                kept(got, value, KINDS.get(name, float))
        assert engine.block_pool.num_free == cache.num_blocks and engine.step_log.maxlen == cfg.step_log_size


# ----- add_request -----
good_prompts = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10).flatmap(lambda p: st.sampled_from([
    p, tuple(p), np.array(p), np.array(p, dtype=np.int16), torch.tensor(p), torch.tensor(p, dtype=torch.int32),
    [np.int64(t) for t in p]]))
bad_prompts = st.one_of(
    st.lists(st.integers(-1, VOCAB), max_size=10),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4).flatmap(lambda p: st.sampled_from([
        np.array(p, dtype=np.float64), torch.tensor(p, dtype=torch.float32), torch.tensor([p]),
        [float(t) for t in p], [True] + p, torch.tensor(p, dtype=torch.bool),
        torch.tensor(p, dtype=torch.complex64)])),
    wild)
prompts = st.one_of(good_prompts, good_prompts, bad_prompts)  # one_of draws its branches about evenly
# what a refusal begins with: an argument, a field checked against the model, or the request as a whole
# (too large for the pool: "request '7' can never fit: prompt 9 + max_tokens 90 needs ...")
ADD_FIELDS = ["prompt_ids", "sampling_params", "request_id", "priority", "arrival_time", "cache_salt", "logit_bias",
              "logprobs", "request"]


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
    "cache_salt": st.one_of(st.none(), st.sampled_from(["s", ""])),
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
            assert len(req.prompt_ids) == len(prompt) and all(kept(g, t, int) for g, t in zip(req.prompt_ids, prompt))
            assert all(0 <= t < VOCAB for t in req.prompt_ids) and kept(req.priority, kw.get("priority", 0), int)
            assert type(req.arrival_time) is float
            assert kw.get("arrival_time") is None or kept(req.arrival_time, kw["arrival_time"], float)
        if engine.has_unfinished():
            engine.step()
    # The engine still runs a good request to the tokens it gets alone.
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[good].output_ids == alone((5, 6, 7), 4)
    assert engine.block_pool.num_free == 24
